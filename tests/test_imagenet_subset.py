"""lab/scripts/make_imagenet_subset.py: N classes (and M train images each) of ImageNet, hard-linked or copied,
resumable, verified; and the kit's ``imagenet`` preset reads such a subset (and Imagenette's 10 classes).

The source is made here in ImageNet's exact layout after lab/scripts/sort_imagenet_val.py: train/<wnid>/<wnid>_<n>.JPEG
and val/<wnid>/ILSVRC2012_val_<8 digits>.JPEG, small real JPEGs (the kit's check opens them), a different number
of training images per class as in ImageNet (732 to 1300 there).
"""
from __future__ import annotations

import errno
import hashlib
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from tests.helpers.lab_scripts import SCRIPTS, load

subset = load("make_imagenet_subset")

WNIDS = sorted(f"n{1440764 + 40517 * k:08d}" for k in range(12))   # 12 classes, wnid-shaped, sorted
VAL_PER_CLASS = 3


def train_count(k: int) -> int:
    return 4 + k % 3   # 4, 5 or 6 training images: classes differ in size, as ImageNet's do


def make_imagenet(root: Path, wnids: list[str] = WNIDS, val_wnids: list[str] | None = None) -> Path:
    """ImageNet's layout with val sorted into class folders; each image a distinct 8 x 8 JPEG."""
    rng = random.Random(0)
    val_index = 0
    for k, wnid in enumerate(wnids):
        (root / "train" / wnid).mkdir(parents=True)
        for i in range(train_count(k)):
            jpeg(root / "train" / wnid / f"{wnid}_{rng.randrange(10**5)}.JPEG", rng)
    for wnid in val_wnids or wnids:
        (root / "val" / wnid).mkdir(parents=True)
        for _ in range(VAL_PER_CLASS):
            val_index += 1
            jpeg(root / "val" / wnid / f"ILSVRC2012_val_{val_index:08d}.JPEG", rng)
    return root


def jpeg(path: Path, rng: random.Random) -> None:
    Image.new("RGB", (8, 8), tuple(rng.randrange(256) for _ in range(3))).save(path, quality=95)


def files(root: Path) -> dict[str, str]:
    """{path below root: content hash} of every file."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path):
    return make_imagenet(tmp_path / "imagenet")


def run(src: Path, dst: Path, *extra) -> int:
    return subset.main([str(src), str(dst), *map(str, extra)])


def test_takes_classes_spread_over_the_sorted_list_with_every_image_hard_linked(src, tmp_path, capsys):
    before = files(src)
    dst = tmp_path / "imagenet-4"
    assert run(src, dst, "--classes", 4) == 0
    chosen = [WNIDS[0], WNIDS[3], WNIDS[6], WNIDS[9]]                    # every 3rd of 12, from the first
    for split in ("train", "val"):
        assert sorted(p.name for p in (dst / split).iterdir()) == chosen
    expected = {rel: h for rel, h in before.items() if rel.split("/")[1] in chosen}
    assert files(dst) == expected                                       # every image of those classes, nothing else
    for rel in expected:
        assert (dst / rel).samefile(src / rel)                          # hard links: no extra disk
    assert files(src) == before                                         # the source is untouched
    out = capsys.readouterr().out
    n_train = sum(train_count(WNIDS.index(w)) for w in chosen)
    assert f"linked: {len(expected)}" in out
    assert f"OK: {dst} holds 4 classes, {n_train} train and {4 * VAL_PER_CLASS} val images" in out


def test_the_default_is_100_classes_and_a_source_with_fewer_is_a_clear_error(src, tmp_path, capsys):
    assert subset.parse_args(["a", "b"]).classes == 100
    assert run(src, tmp_path / "out") == 2
    assert "--classes 100: SRC has 12 classes; choose 1 to 12" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_node_picks_the_same_classes_from_its_own_copy(tmp_path):
    one, two = make_imagenet(tmp_path / "node1"), make_imagenet(tmp_path / "node2")
    assert subset.choose(one, 5, None) == subset.choose(two, 5, None) == [WNIDS[i] for i in (0, 2, 4, 7, 9)]


def test_per_class_keeps_the_first_training_images_by_name_and_all_validation_images(src, tmp_path):
    dst = tmp_path / "small"
    assert run(src, dst, "--classes", 2, "--per-class", 3) == 0
    for wnid in (WNIDS[0], WNIDS[6]):
        assert sorted(p.name for p in (dst / "train" / wnid).iterdir()) == \
            sorted(p.name for p in (src / "train" / wnid).iterdir())[:3]
        assert len(list((dst / "val" / wnid).iterdir())) == VAL_PER_CLASS


def test_copy_writes_independent_files_with_the_same_bytes(src, tmp_path, capsys):
    dst = tmp_path / "copied"
    assert run(src, dst, "--classes", 3, "--copy") == 0
    images = [p for p in dst.rglob("*.JPEG")]
    assert images and not any(p.samefile(src / p.relative_to(dst)) for p in images)
    assert all(p.read_bytes() == (src / p.relative_to(dst)).read_bytes() for p in images)
    assert f"copied: {len(images)}" in capsys.readouterr().out


def test_another_file_system_falls_back_to_copies_and_says_so(src, tmp_path, capsys, monkeypatch):
    def no_link(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(subset.os, "link", no_link)
    dst = tmp_path / "elsewhere"
    assert run(src, dst, "--classes", 2) == 0
    out = capsys.readouterr().out
    assert "another file system than the source's: no hard links" in out and "linked: 0" in out
    assert files(dst) == {rel: h for rel, h in files(src).items() if rel.split("/")[1] in (WNIDS[0], WNIDS[6])}


def test_copies_that_do_not_fit_are_refused_before_writing(src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(subset.shutil, "disk_usage", lambda path: SimpleNamespace(total=100, used=90, free=10))
    assert run(src, tmp_path / "full", "--classes", 2, "--copy") == 2
    assert "not enough free space" in capsys.readouterr().err
    assert not list((tmp_path / "full").rglob("*.JPEG"))


def test_a_second_run_skips_every_finished_image(src, tmp_path, capsys):
    dst = tmp_path / "again"
    assert run(src, dst, "--classes", 4, "--copy") == 0
    stamps = {p: p.stat().st_mtime_ns for p in dst.rglob("*.JPEG")}
    capsys.readouterr()
    assert run(src, dst, "--classes", 4, "--copy") == 0
    assert f"skipped: {len(stamps)}, linked: 0, copied: 0" in capsys.readouterr().out
    assert stamps == {p: p.stat().st_mtime_ns for p in dst.rglob("*.JPEG")}


def test_an_interrupted_run_is_finished_and_leaves_no_half_written_file(src, tmp_path):
    dst = tmp_path / "cut"
    assert run(src, dst, "--classes", 4) == 0
    complete = files(dst)
    images = sorted(dst.rglob("*.JPEG"))
    for gone in images[:3]:
        gone.unlink()
    images[3].unlink()
    images[3].with_name(images[3].name + ".partial").write_bytes(b"\xff\xd8")   # a copy cut short
    assert run(src, dst, "--classes", 4, "--verify-only") == 1
    assert run(src, dst, "--classes", 4) == 0
    assert files(dst) == complete and not list(dst.rglob("*.partial"))


def test_verification_names_missing_extra_and_wrongly_sized_images_and_extra_classes(src, tmp_path, capsys):
    dst = tmp_path / "checked"
    assert run(src, dst, "--classes", 4, "--copy") == 0
    capsys.readouterr()
    first = sorted((dst / "train" / WNIDS[0]).iterdir())
    first[0].unlink()                                                      # missing
    first[1].write_bytes(b"\xff\xd8 cut short")                           # wrong size
    (dst / "train" / WNIDS[3] / "stray.JPEG").write_bytes(b"\xff\xd8")   # extra image
    (dst / "val" / WNIDS[1]).mkdir()                                      # extra class (an earlier run)
    assert run(src, dst, "--classes", 4, "--verify-only") == 1
    err = capsys.readouterr().err
    assert f"1 images are missing (run the script again): train/{WNIDS[0]}/{first[0].name}" in err
    assert f"differ in size from their source (delete them and run again): train/{WNIDS[0]}/{first[1].name}" in err
    assert f"not part of this subset (left from a run with other settings? delete DST and run again): " \
           f"train/{WNIDS[3]}/stray.JPEG" in err
    assert f"val/: class folders differ from the chosen ones (missing: none; extra: {WNIDS[1]})" in err


def test_verify_only_without_a_subset_says_to_make_it(src, tmp_path, capsys):
    assert run(src, tmp_path / "none", "--classes", 2, "--verify-only") == 1
    assert "does not exist (run the script without --verify-only)" in capsys.readouterr().err


def test_an_unsorted_val_folder_is_refused_with_the_script_that_sorts_it(tmp_path, capsys):
    src = make_imagenet(tmp_path / "imagenet")
    for image in list((src / "val").rglob("*.JPEG")):
        image.rename(src / "val" / image.name)
    for folder in list((src / "val").iterdir()):
        if folder.is_dir():
            folder.rmdir()
    assert run(src, tmp_path / "out", "--classes", 2) == 2
    assert f"holds {len(WNIDS) * VAL_PER_CLASS} images directly, not in class folders: sort them first with " \
           "lab/scripts/sort_imagenet_val.py" in capsys.readouterr().err


def test_train_and_val_with_different_classes_is_refused(tmp_path, capsys):
    src = make_imagenet(tmp_path / "imagenet", val_wnids=WNIDS[:-1])
    assert run(src, tmp_path / "out", "--classes", 2) == 2
    assert f"train only: {WNIDS[-1]}; val only: none" in capsys.readouterr().err


def test_a_class_list_names_the_classes_and_may_use_a_source_with_fewer_train_classes(tmp_path, capsys):
    chosen = [WNIDS[5], WNIDS[1]]
    src = make_imagenet(tmp_path / "partial", wnids=chosen, val_wnids=WNIDS)   # a selective unzip: all of val
    listed = tmp_path / "classes.txt"
    listed.write_text(f"# two classes\n{WNIDS[5]} tabby cat\n\n{WNIDS[1]}\n{WNIDS[5]}\n")
    dst = tmp_path / "named"
    assert run(src, dst, "--class-list", listed) == 0
    assert sorted(p.name for p in (dst / "train").iterdir()) == sorted(chosen)
    assert sorted(p.name for p in (dst / "val").iterdir()) == sorted(chosen)
    listed.write_text(f"{WNIDS[1]}\n{WNIDS[2]}\n")
    assert run(src, tmp_path / "other", "--class-list", listed) == 2
    assert f"1 classes are not in SRC: {WNIDS[2]} (train)" in capsys.readouterr().err


def test_the_subset_may_not_go_into_the_source(src):
    for dst in (src, src / "subset", src / "train" / "x"):
        with pytest.raises(SystemExit) as stop:
            subset.parse_args([str(src), str(dst)])
        assert stop.value.code == 2


def test_the_kits_imagenet_preset_reads_the_subset(src, tmp_path):
    from ddp_utils.datasets import check_data
    from ddp_utils.settings import Settings

    dst = tmp_path / "imagenet-4"
    assert run(src, dst, "--classes", 4) == 0
    found = check_data(Settings(dataset="imagenet", data_dir=str(dst)))
    assert found["classes"] == [WNIDS[i] for i in (0, 3, 6, 9)]
    assert found["splits"] == {"train": {"images": sum(train_count(i) for i in (0, 3, 6, 9)), "classes": 4},
                               "val": {"images": 4 * VAL_PER_CLASS, "classes": 4}}


def test_the_kits_imagenet_preset_reads_imagenettes_layout_of_10_classes(tmp_path):
    """Imagenette (fast.ai's 10 ImageNet classes, no account needed) unpacks to train/<wnid>/ and val/<wnid>/
    beside a CSV; the imagenet preset counts the class folders, so it trains on it as it is."""
    from ddp_utils.datasets import check_data
    from ddp_utils.settings import Settings

    root = make_imagenet(tmp_path / "imagenette2-320", wnids=WNIDS[:10])
    (root / "noisy_imagenette.csv").write_text("path,noisy_labels_0,is_valid\n")
    found = check_data(Settings(dataset="imagenet", data_dir=str(root)))
    assert len(found["classes"]) == 10 and found["splits"]["val"] == {"images": 10 * VAL_PER_CLASS, "classes": 10}


def test_the_script_runs_from_the_command_line(src, tmp_path):
    script = SCRIPTS / "make_imagenet_subset.py"
    assert "--per-class" in subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                                           text=True, check=True).stdout
    result = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "cli"), "--classes", "3"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "OK:" in result.stdout and "hard links into" in result.stdout
