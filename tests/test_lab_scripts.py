"""The data-preparation scripts in lab/scripts/, run on tiny fake data sets in the real layouts.

ImageNet val: a flat folder of ILSVRC2012_val_<8 digits>.JPEG files plus LOC_val_solution.csv (or the
other ground-truth forms). CINIC-10: a .tar.gz with train/ valid/ test/, ten class folders each, PNGs.
Counts are small and passed with --expect-classes / --expect-per-class.
"""
from __future__ import annotations

import hashlib
import io
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers.lab_scripts import SCRIPTS, load

REPO = Path(__file__).resolve().parents[1]
# tarfile's "data" filter where this Python has it (3.12, and 3.11.4+; Debian 12's own 3.11.2 has not)
DATA_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


sort_val = load("sort_imagenet_val")
cinic = load("prepare_cinic10")


# -- a fake ImageNet validation folder ----------------------------------------------------------------

N_CLASSES, PER_CLASS = 4, 3
# Deliberately not in sorted order, like the devkit's ILSVRC2012_ID order.
WNIDS = ["n02119789", "n01440764", "n04592741", "n03000134"]


def make_val(tmp_path: Path, n_classes: int = N_CLASSES, per_class: int = PER_CLASS, seed: int = 0):
    """Flat val/ folder + every ground-truth form. Returns (val_dir, {file name: wnid}, files dict)."""
    rng = random.Random(seed)
    labels = [WNIDS[c] for c in range(n_classes) for _ in range(per_class)]
    rng.shuffle(labels)
    val = tmp_path / "val"
    val.mkdir()
    mapping = {}
    for i, wnid in enumerate(labels, start=1):
        name = f"ILSVRC2012_val_{i:08d}.JPEG"
        # Tiny but distinct contents, so a lost or swapped file would be noticed.
        (val / name).write_bytes(b"\xff\xd8\xff" + f"image {i} of {wnid}".encode())
        mapping[name] = wnid

    rows = [f"{n[:-5]},{w} 10 20 30 40 {w} 1 2 3 4" for n, w in mapping.items()]
    rng.shuffle(rows)   # Kaggle's file is not in image order
    files = {"csv": tmp_path / "LOC_val_solution.csv", "wnids": tmp_path / "val_wnids.txt",
             "indices": tmp_path / "ILSVRC2012_validation_ground_truth.txt", "synsets": tmp_path / "synsets.txt"}
    files["csv"].write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    files["wnids"].write_text("\n".join(labels) + "\n")
    files["indices"].write_text("\n".join(str(WNIDS.index(w) + 1) for w in labels) + "\n")
    files["synsets"].write_text("\n".join(WNIDS[:n_classes]) + "\n")
    return val, mapping, files


def expect(n_classes: int = N_CLASSES, per_class: int = PER_CLASS) -> list[str]:
    return ["--expect-classes", str(n_classes), "--expect-per-class", str(per_class)]


def digest(folder: Path) -> dict[str, str]:
    """{file name: content hash} of every file below ``folder``: what must never be lost."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def assert_sorted(val: Path, mapping: dict[str, str]):
    for name, wnid in mapping.items():
        assert (val / wnid / name).is_file(), f"{name} not in {wnid}/"
        assert not (val / name).exists(), f"{name} still flat"


def test_imagenet_defaults_are_1000_classes_of_50_images():
    args = sort_val.parse_args(["val", "--labels", "x.csv"])
    assert (args.expect_classes, args.expect_per_class) == (1000, 50)


@pytest.mark.parametrize("form", ["csv", "wnids"])
def test_sorts_flat_val_into_class_folders(tmp_path, capsys, form):
    val, mapping, files = make_val(tmp_path)
    before = digest(val)
    assert sort_val.main([str(val), "--labels", str(files[form]), *expect()]) == 0
    assert_sorted(val, mapping)
    assert digest(val) == before
    assert "OK" in capsys.readouterr().out


def test_sorts_from_devkit_class_ids_with_a_synsets_list(tmp_path):
    val, mapping, files = make_val(tmp_path)
    code = sort_val.main([str(val), "--labels", str(files["indices"]), "--synsets", str(files["synsets"]),
                          *expect()])
    assert code == 0
    assert_sorted(val, mapping)


def test_sorts_from_devkit_class_ids_with_meta_mat(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    import numpy as np
    val, mapping, files = make_val(tmp_path)
    # meta.mat also lists non-leaf synsets (num_children > 0, ids above 1000); they must be skipped.
    records = [(k + 1, w, 0) for k, w in enumerate(WNIDS)] + [(len(WNIDS) + 1, "n00001740", 3)]
    synsets = np.array(records, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    scipy_io.savemat(tmp_path / "meta.mat", {"synsets": synsets})
    code = sort_val.main([str(val), "--labels", str(files["indices"]), "--synsets", str(tmp_path / "meta.mat"),
                          *expect()])
    assert code == 0
    assert_sorted(val, mapping)


def test_class_ids_without_synsets_is_a_clear_error(tmp_path, capsys):
    val, _, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["indices"]), *expect()]) == 2
    assert "--synsets" in capsys.readouterr().err


def test_unreadable_ground_truth_is_a_clear_error(tmp_path, capsys):
    val, _, _ = make_val(tmp_path)
    bad = tmp_path / "labels.csv"
    bad.write_text("ImageId,Label\nILSVRC2012_val_00000001,n01440764\n")
    assert sort_val.main([str(val), "--labels", str(bad), "--format", "csv", *expect()]) == 2
    assert "ImageId,PredictionString" in capsys.readouterr().err
    assert len(digest(val)) == N_CLASSES * PER_CLASS   # nothing moved


def test_dry_run_changes_nothing(tmp_path, capsys):
    val, _, files = make_val(tmp_path)
    before = sorted(p.relative_to(val) for p in val.rglob("*"))
    assert sort_val.main([str(val), "--labels", str(files["csv"]), "--dry-run", *expect()]) == 0
    assert sorted(p.relative_to(val) for p in val.rglob("*")) == before
    assert f"moved: {N_CLASSES * PER_CLASS}" in capsys.readouterr().out


def test_dry_run_reports_wrong_ground_truth_counts(tmp_path, capsys):
    val, _, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["csv"]), "--dry-run", *expect(N_CLASSES, 5)]) == 1
    assert "do not have 5 images" in capsys.readouterr().err


def test_copy_keeps_the_flat_files(tmp_path):
    val, mapping, files = make_val(tmp_path)
    out = tmp_path / "val_sorted"
    assert sort_val.main([str(val), "--labels", str(files["csv"]), "--copy", "--out-dir", str(out),
                          *expect()]) == 0
    assert all((val / n).is_file() and (out / w / n).read_bytes() == (val / n).read_bytes()
               for n, w in mapping.items())


def test_copy_in_place_is_verified_without_complaining_about_the_originals(tmp_path):
    val, mapping, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["csv"]), "--copy", *expect()]) == 0
    assert all((val / n).is_file() and (val / w / n).is_file() for n, w in mapping.items())


def test_rerun_on_a_sorted_folder_changes_nothing(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    argv = [str(val), "--labels", str(files["csv"]), *expect()]
    assert sort_val.main(argv) == 0
    before = digest(val)
    assert sort_val.main(argv) == 0
    assert digest(val) == before
    assert f"done: {N_CLASSES * PER_CLASS}" in capsys.readouterr().out


def test_rerun_after_an_interrupted_run_finishes_the_job_and_loses_nothing(tmp_path):
    val, mapping, files = make_val(tmp_path)
    before = digest(val)
    names = sorted(mapping)
    # Interrupted run: some images moved, one half-written copy, one image both flat and sorted.
    for name in names[:5]:
        (val / mapping[name]).mkdir(exist_ok=True)
        (val / name).rename(val / mapping[name] / name)
    (val / mapping[names[5]]).mkdir(exist_ok=True)
    (val / mapping[names[5]] / (names[5] + ".partial")).write_bytes(b"\xff\xd8")
    (val / mapping[names[6]]).mkdir(exist_ok=True)
    (val / mapping[names[6]] / names[6]).write_bytes((val / names[6]).read_bytes())

    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 0
    assert_sorted(val, mapping)
    assert not list(val.rglob("*.partial"))
    assert digest(val) == before


def test_interrupted_copy_leaves_no_half_file_and_is_redone(tmp_path, monkeypatch):
    val, mapping, files = make_val(tmp_path)
    out = tmp_path / "out"
    argv = [str(val), "--labels", str(files["csv"]), "--copy", "--out-dir", str(out), *expect()]
    real_replace = sort_val.os.replace
    calls = {"n": 0}

    def crash_on_third(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt   # the user presses Ctrl-C mid-copy
        real_replace(src, dst)

    monkeypatch.setattr(sort_val.os, "replace", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        sort_val.main(argv)
    assert len(list(out.rglob("*.partial"))) == 1
    assert len(list(out.rglob("*.JPEG"))) == 2        # only complete copies carry the image name
    monkeypatch.setattr(sort_val.os, "replace", real_replace)
    assert sort_val.main(argv) == 0
    assert not list(out.rglob("*.partial"))
    assert all((out / w / n).read_bytes() == (val / n).read_bytes() for n, w in mapping.items())


def test_a_flat_file_that_differs_from_its_sorted_copy_is_kept_and_reported(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    name = sorted(mapping)[0]
    (val / mapping[name]).mkdir()
    (val / mapping[name] / name).write_bytes(b"something else")
    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 1
    assert (val / name).is_file() and (val / mapping[name] / name).read_bytes() == b"something else"
    assert "different contents" in capsys.readouterr().err


def test_missing_image_is_reported_by_name(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    (val / "ILSVRC2012_val_00000007.JPEG").unlink()
    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 1
    err = capsys.readouterr().err
    assert "ILSVRC2012_val_00000007.JPEG" in err and "exist neither flat nor sorted" in err
    assert f"{mapping['ILSVRC2012_val_00000007.JPEG']}=2" in err   # and its class is one short


def test_verification_catches_a_missing_class(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 0
    for p in (val / WNIDS[2]).iterdir():
        p.unlink()
    (val / WNIDS[2]).rmdir()
    assert sort_val.main([str(val), "--verify-only", *expect()]) == 1
    assert f"{N_CLASSES - 1} class folders, expected {N_CLASSES}" in capsys.readouterr().err


def test_verification_catches_wrong_counts_per_class(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 0
    capsys.readouterr()
    assert sort_val.main([str(val), "--verify-only", *expect(N_CLASSES, 50)]) == 1
    err = capsys.readouterr().err
    assert f"{N_CLASSES} classes do not have 50 images" in err and f"{WNIDS[0]}={PER_CLASS}" in err


def test_verification_catches_an_image_in_the_wrong_class(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    assert sort_val.main([str(val), "--labels", str(files["csv"]), *expect()]) == 0
    a = next(n for n, w in mapping.items() if w == WNIDS[0])
    b = next(n for n, w in mapping.items() if w == WNIDS[1])
    (val / WNIDS[0] / a).rename(val / WNIDS[1] / a)   # swap two images: counts stay right
    (val / WNIDS[1] / b).rename(val / WNIDS[0] / b)
    assert sort_val.main([str(val), "--verify-only", *expect()]) == 0   # counts alone cannot see it
    assert sort_val.main([str(val), "--verify-only", "--labels", str(files["csv"]), *expect()]) == 1
    assert "2 images are in the wrong class folder" in capsys.readouterr().err


def test_train_classes_missing_from_val_are_reported(tmp_path, capsys):
    val, mapping, files = make_val(tmp_path)
    train = tmp_path / "train"
    for wnid in WNIDS[:N_CLASSES] + ["n09999999"]:
        (train / wnid).mkdir(parents=True)
    code = sort_val.main([str(val), "--labels", str(files["csv"]), "--train-dir", str(train), *expect()])
    assert code == 1
    assert "1 train classes have no val folder: n09999999" in capsys.readouterr().err
    (train / "n09999999").rmdir()
    assert sort_val.main([str(val), "--verify-only", "--train-dir", str(train), *expect()]) == 0


def test_sort_script_runs_from_the_command_line(tmp_path):
    val, mapping, files = make_val(tmp_path)
    script = SCRIPTS / "sort_imagenet_val.py"
    assert "--dry-run" in subprocess.run([sys.executable, str(script), "-h"], capture_output=True,
                                         text=True, check=True).stdout
    result = subprocess.run([sys.executable, str(script), str(val), "--labels", str(files["csv"]),
                             *expect(N_CLASSES, PER_CLASS + 1)], capture_output=True, text=True)
    assert result.returncode == 1 and "PROBLEM" in result.stderr
    assert_sorted(val, mapping)   # sorted anyway; only the expectation was wrong


# -- a fake CINIC-10 archive ------------------------------------------------------------------------

def png(size=(32, 32), mode="RGB", seed=0) -> bytes:
    from PIL import Image
    rng = random.Random(seed)
    im = Image.new(mode, size, tuple(rng.randrange(256) for _ in mode) if len(mode) > 1 else rng.randrange(256))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def make_cinic_tar(tmp_path: Path, per_class: int = 2, top: str = "", extra: dict | None = None) -> Path:
    """CINIC-10.tar.gz in the real layout with ``per_class`` images per class and split.

    ``top`` wraps everything in a folder; ``extra`` adds {archive path: bytes or None to drop it}.
    """
    members: dict[str, bytes | None] = {}
    for split in cinic.SPLITS:
        for c, name in enumerate(cinic.CLASSES):
            for i in range(per_class):
                members[f"{split}/{name}/cifar10-{split}-{c * 100 + i}.png"] = png(seed=c * 100 + i)
    members.update(extra or {})
    archive = tmp_path / "CINIC-10.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, data in members.items():
            if data is None:
                continue
            info = tarfile.TarInfo((top + "/" if top else "") + path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_cinic_defaults_are_9000_images_per_class_in_three_splits_of_ten_classes():
    assert cinic.SPLITS == ("train", "valid", "test")
    assert cinic.CLASSES == ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                             "ship", "truck")
    assert cinic.parse_args(["--target", "t", "--verify-only"]).expect_per_class == 9000


@pytest.mark.parametrize("top", ["", "CINIC-10"])
def test_unpacks_the_archive_and_verifies_it(tmp_path, capsys, top):
    archive = make_cinic_tar(tmp_path, top=top)
    target = tmp_path / "cinic10"
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "2"]) == 0
    for split in cinic.SPLITS:
        assert sorted(p.name for p in (target / split).iterdir()) == sorted(cinic.CLASSES)
        assert len(list((target / split / "cat").glob("*.png"))) == 2
    assert not (target / cinic.UNPACKING).exists()
    assert "OK" in capsys.readouterr().out


def test_second_run_skips_unpacking(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path)
    target = tmp_path / "cinic10"
    argv = ["--archive", str(archive), "--target", str(target), "--expect-per-class", "2"]
    assert cinic.main(argv) == 0
    marker = target / "train" / "cat" / "mine.txt"   # would vanish if the folder were unpacked again
    marker.write_text("keep")
    archive.unlink()                                  # not even needed any more
    capsys.readouterr()
    assert cinic.main(argv) == 0
    assert "already unpacked" in capsys.readouterr().out and marker.exists()


def test_leftovers_of_an_interrupted_unpack_are_cleaned_up(tmp_path):
    archive = make_cinic_tar(tmp_path)
    target = tmp_path / "cinic10"
    (target / cinic.UNPACKING / "train" / "cat").mkdir(parents=True)
    (target / cinic.UNPACKING / "train" / "cat" / "half.png").write_bytes(b"\x89PNG")
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "2"]) == 0
    assert not (target / cinic.UNPACKING).exists()


def test_verify_only_accepts_an_unpacked_folder(tmp_path):
    archive = make_cinic_tar(tmp_path, per_class=3)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "manual", **DATA_FILTER)
    assert cinic.main(["--target", str(tmp_path / "manual"), "--verify-only", "--expect-per-class", "3",
                       "--full"]) == 0


def test_verify_only_and_archive_together_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        cinic.parse_args(["--target", str(tmp_path), "--verify-only", "--archive", "x.tar.gz"])
    assert e.value.code == 2


def test_missing_class_is_named(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path)
    target = tmp_path / "cinic10"
    with tarfile.open(archive) as tar:
        tar.extractall(target, **DATA_FILTER)
    for p in (target / "valid" / "dog").iterdir():
        p.unlink()
    (target / "valid" / "dog").rmdir()
    assert cinic.main(["--target", str(target), "--verify-only", "--expect-per-class", "2"]) == 1
    assert "valid/dog: class folder missing" in capsys.readouterr().err


def test_wrong_count_names_split_class_and_counts(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path, extra={"test/ship/extra-1.png": png(seed=9)})
    target = tmp_path / "cinic10"
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "2"]) == 1
    err = capsys.readouterr().err
    assert "test/ship: 3 images, expected 2" in err
    assert err.count("images, expected") == 1


def test_default_expectation_reports_the_real_count(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path)
    assert cinic.main(["--archive", str(archive), "--target", str(tmp_path / "c")]) == 1
    assert "train/airplane: 2 images, expected 9,000" in capsys.readouterr().err


def test_an_extra_class_folder_is_a_problem(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path, extra={"train/unicorn/u.png": png()})
    assert cinic.main(["--archive", str(archive), "--target", str(tmp_path / "c"), "--expect-per-class", "2"]) == 1
    assert "train/unicorn: unexpected folder" in capsys.readouterr().err


def test_wrong_image_size_and_broken_png_are_caught(tmp_path, capsys):
    extra = {"train/frog/cifar10-train-600.png": png(size=(64, 64)),      # replaces a good image
             "valid/bird/cifar10-valid-200.png": b"\x89PNG\r\n\x1a\n broken"}
    archive = make_cinic_tar(tmp_path, extra=extra)
    argv = ["--archive", str(archive), "--target", str(tmp_path / "c"), "--expect-per-class", "2", "--full"]
    assert cinic.main(argv) == 1
    err = capsys.readouterr().err
    assert "train/frog: 1 of 2 opened images are bad" in err and "64x64 pixels, expected 32x32" in err
    assert "valid/bird: 1 of 2 opened images are bad" in err and "cannot be read as an image" in err


def test_sample_opens_only_some_images_and_full_opens_all(tmp_path, monkeypatch):
    archive = make_cinic_tar(tmp_path, per_class=4)
    target = tmp_path / "c"
    opened = []
    real = cinic.check_image
    monkeypatch.setattr(cinic, "check_image", lambda p: (opened.append(p), real(p))[1])
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "4",
                       "--sample", "1"]) == 0
    assert len(opened) == 30
    opened.clear()
    assert cinic.main(["--target", str(target), "--verify-only", "--expect-per-class", "4", "--full"]) == 0
    assert len(opened) == 120


def test_grayscale_images_are_a_note_unless_strict_rgb(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path, extra={"test/horse/cifar10-test-700.png": png(mode="L")})
    target = tmp_path / "c"
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "2", "--full"]) == 0
    assert "1 L" in capsys.readouterr().out
    assert cinic.main(["--target", str(target), "--verify-only", "--expect-per-class", "2", "--full",
                       "--strict-rgb"]) == 1
    assert "mode L, not RGB" in capsys.readouterr().err


def test_an_archive_that_writes_outside_the_target_is_refused(tmp_path, capsys):
    archive = make_cinic_tar(tmp_path, extra={"../evil.png": png()})
    target = tmp_path / "c"
    assert cinic.main(["--archive", str(archive), "--target", str(target), "--expect-per-class", "2"]) == 2
    assert not (tmp_path / "c" / "evil.png").exists() and not (target.parent / "evil.png").exists()
    assert not (target / cinic.UNPACKING).exists()
    assert capsys.readouterr().err.startswith("error:")


def test_unsafe_archive_is_refused_also_on_pythons_without_the_tar_data_filter(tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    archive = make_cinic_tar(tmp_path, extra={"../evil.png": png()})
    assert cinic.main(["--archive", str(archive), "--target", str(tmp_path / "c"), "--expect-per-class", "2"]) == 2
    assert "refusing suspicious archive member '../evil.png'" in capsys.readouterr().err
    assert not (tmp_path / "evil.png").exists() and not (tmp_path / "c" / cinic.UNPACKING).exists()


def test_an_archive_without_the_splits_is_refused(tmp_path, capsys):
    archive = tmp_path / "other.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cats/cat.png")
        data = png()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert cinic.main(["--archive", str(archive), "--target", str(tmp_path / "c")]) == 2
    assert "is it CINIC-10?" in capsys.readouterr().err


def test_cinic_script_runs_from_the_command_line(tmp_path):
    archive = make_cinic_tar(tmp_path)
    script = SCRIPTS / "prepare_cinic10.py"
    result = subprocess.run([sys.executable, str(script), "--archive", str(archive), "--target",
                             str(tmp_path / "c"), "--expect-per-class", "2"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "OK: CINIC-10" in result.stdout
