"""lab/scripts/resize_imagenet.py: a resized copy of ImageNet, made in parallel, resumable, atomic, verified.

The source is a small ImageNet-layout folder of real photos (tests/test_fastjpeg.py's, 70-150 px) resized to
a short side of 64 px, the smallest the script allows, so that some images are resized and some copied.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.helpers.folders import make_photo_imagenet
from tests.helpers.lab_scripts import SCRIPTS, load

resize = load("resize_imagenet")
sys.modules.setdefault("resize_imagenet", resize)   # its pool workers find resize_one by module name
SHORT = 64


N = 22   # images in the source


@pytest.fixture
def src(tmp_path):
    root = make_photo_imagenet(tmp_path / "imagenet")   # 3 classes, 12 train and 9 val photos, 70-150 px
    with Image.open(next((root / "val" / "n01440764").iterdir())) as photo:
        photo.resize((60, 50)).save(root / "val" / "n01440764" / "small.JPEG")   # already below 64 px: copied
    return root


def run(src, dst, *extra) -> int:
    return resize.main([str(src), str(dst), "--short-side", str(SHORT), "--processes", "2", "--no-progress",
                        *map(str, extra)])


def images(root):
    return sorted(p.relative_to(root) for p in root.rglob("*.JPEG"))


def test_resizes_to_the_short_side_copies_small_images_and_keeps_names_and_classes(src, tmp_path, capsys):
    dst = tmp_path / "copy"
    assert run(src, dst) == 0
    assert images(dst) == images(src) and len(images(src)) == N
    outcomes = capsys.readouterr().out
    resized = copied = 0
    for rel in images(src):
        with Image.open(src / rel) as a, Image.open(dst / rel) as b:
            if min(a.size) <= SHORT:
                assert (dst / rel).read_bytes() == (src / rel).read_bytes()     # copied byte for byte
                copied += 1
            else:
                assert min(b.size) == SHORT and abs(b.size[0] / b.size[1] - a.size[0] / a.size[1]) < 0.05
                resized += 1
    assert resized and copied and f"copied: {copied}, resized: {resized}" in outcomes and "OK:" in outcomes


def test_a_big_jpeg_decoded_at_a_reduced_scale_still_gets_the_exact_short_side(tmp_path):
    from sklearn.datasets import load_sample_images
    photo = Image.fromarray(load_sample_images().images[0])               # 640 x 427
    photo.save(tmp_path / "big.JPEG", quality=95)
    _, outcome, _ = resize.resize_one((str(tmp_path / "big.JPEG"), str(tmp_path / "out.JPEG"), 100, 95))
    with Image.open(tmp_path / "out.JPEG") as out:
        assert outcome == "resized" and out.size == resize.target_size((640, 427), 100) == (150, 100)
        full = photo.resize(out.size, Image.Resampling.BICUBIC)           # without the reduced-scale decode
        assert np.abs(np.asarray(out, dtype=float) - np.asarray(full, dtype=float)).mean() < 6   # levels of 255


def test_a_second_run_skips_every_finished_image(src, tmp_path, capsys):
    dst = tmp_path / "copy"
    assert run(src, dst) == 0
    stamps = {rel: (dst / rel).stat().st_mtime_ns for rel in images(dst)}
    capsys.readouterr()
    assert run(src, dst) == 0
    assert f"skipped: {N}, copied: 0, resized: 0" in capsys.readouterr().out
    assert stamps == {rel: (dst / rel).stat().st_mtime_ns for rel in images(dst)}


def test_a_write_cut_short_leaves_no_image_and_the_next_run_redoes_it(src, tmp_path, monkeypatch):
    rel = next(r for r in images(src) if min(Image.open(src / r).size) > SHORT)   # one that gets resized
    dst = tmp_path / "copy"

    def killed_mid_write(self, fp, *args, **kwargs):
        open(fp, "wb").write(b"\xff\xd8\xff half a JPEG")
        raise KeyboardInterrupt   # as if the process were killed here

    monkeypatch.setattr(Image.Image, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        resize.resize_one((str(src / rel), str(dst / rel), SHORT, 90))
    assert not (dst / rel).exists() and (dst / rel).with_name(rel.name + ".partial").exists()
    monkeypatch.undo()
    assert run(src, dst) == 0                      # resumes: every image written, the leftover gone
    assert images(dst) == images(src) and not list(dst.rglob("*.partial"))
    assert min(Image.open(dst / rel).size) == SHORT


def test_an_interrupted_run_is_finished_by_the_next(src, tmp_path):
    dst = tmp_path / "copy"
    assert run(src, dst) == 0
    gone = images(dst)[::3]
    for rel in gone:                               # what a run killed halfway leaves behind
        (dst / rel).unlink()
    (dst / gone[0]).with_name(gone[0].name + ".partial").write_bytes(b"half")
    assert resize.main([str(src), str(dst), "--short-side", str(SHORT), "--verify-only", "--no-progress"]) == 1
    assert run(src, dst) == 0
    assert images(dst) == images(src) and not list(dst.rglob("*.partial"))


def test_verification_names_missing_unreadable_wrongly_sized_and_extra_images(src, tmp_path, capsys):
    dst = tmp_path / "copy"
    assert run(src, dst) == 0
    rels = [r for r in images(dst) if min(Image.open(dst / r).size) == SHORT]
    (dst / rels[0]).unlink()
    (dst / rels[1]).write_bytes((dst / rels[1]).read_bytes()[:200])              # truncated
    Image.new("RGB", (SHORT + 20, SHORT + 20)).save(dst / rels[2], format="JPEG")  # wrong size
    (dst / "val" / "n99999999").mkdir()
    Image.new("RGB", (SHORT, SHORT)).save(dst / "val" / "n99999999" / "stray.JPEG")
    capsys.readouterr()
    assert resize.main([str(src), str(dst), "--short-side", str(SHORT), "--verify-only", "--no-progress"]) == 1
    err = capsys.readouterr().err
    for rel in rels[:3]:
        assert str(rel) in err
    assert "missing from the copy" in err and "unreadable" in err and "of the wrong size" in err
    assert "n99999999" in err and "not in the source" in err


def test_an_unreadable_source_image_is_reported_and_the_rest_is_done(src, tmp_path, capsys):
    bad = src / "train" / "n01440764" / "broken.JPEG"
    bad.write_bytes(b"not a JPEG")
    dst = tmp_path / "copy"
    assert run(src, dst) == 1
    assert str(bad) in capsys.readouterr().err
    assert len(images(dst)) == N                  # every other image is there


def test_help_states_the_measured_speed_up_and_the_script_runs_from_the_command_line(src, tmp_path):
    script = SCRIPTS / "resize_imagenet.py"
    help_text = subprocess.run([sys.executable, str(script), "-h"], capture_output=True, text=True, check=True).stdout
    assert "faster" in " ".join(help_text.split()) and resize.MEASURED["decode"] in help_text
    for flag in ("--short-side", "--processes", "--verify-only"):
        assert flag in help_text
    result = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "copy"), "--short-side", "64",
                             "--processes", "2"], capture_output=True, text=True)
    assert result.returncode == 0 and "OK:" in result.stdout, result.stderr
    refused = subprocess.run([sys.executable, str(script), str(src), str(src)], capture_output=True, text=True)
    assert refused.returncode == 2 and "never writes into the original" in refused.stderr
