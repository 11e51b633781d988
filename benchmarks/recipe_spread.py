"""How much a recipe's exact-DDP accuracy moves from seed to seed: the noise every accuracy comparison sits in.

    python benchmarks/recipe_spread.py --recipe demo --seeds 301-316                 # the demo's defaults
    python benchmarks/recipe_spread.py --recipe study --seeds 301-316                # comm_hooks.py's recipe
    python benchmarks/recipe_spread.py --recipe study --seeds 201-204 --set label_smoothing=0.1 --out /tmp/try.json

For each seed, one after the other: two ranks of exact DDP (``--comm none``, gloo on loopback, one CPU thread
each), the recipe's settings plus ``--set`` (``key=value``, any setting), then the final Acc@1 and validation loss.
``demo``: ``python -m ddp_utils demo``'s recipe (the demo preset's: convnet, batch 32 per rank, 8 epochs, lr 0.8 at
256, half an epoch of warm-up); ``study``: benchmarks/comm_hooks.py's (ResNet-18 at 32 px, the in-memory loader,
batch 64 per rank, lr 0.1 at 256, 8 epochs). A recipe is changed on seeds other than those it is judged on
(issue 58: sd of Acc@1 at most 1 point over 16 fresh seeds). Accuracy does not depend on the machine's load; the
wall time does (not a figure here).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ddp_utils.settings import Settings  # noqa: E402
from tests.helpers.procs import base_env, describe, free_port, python, run_all  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

RECIPES = {
    "demo": {"dataset": "demo"},   # every recipe field from the demo preset
    # comm_hooks.py's (its --lr default: 0.1 since this study; 0.2 before, sd 2.27 over seeds 201-208)
    "study": {"dataset": "demo", "loader": "memory", "arch": "resnet18", "batch_size": 64, "lr": 0.1, "epochs": 8},
}
SD_MARK = 1.0   # points of Acc@1: issue 58's mark for a recipe the studies may use


def seeds(text: str) -> list[int]:
    """``301-316`` or ``1,2,3``."""
    if "-" in text:
        first, last = map(int, text.split("-"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def overrides(pairs: list[str]) -> dict:
    """``["label_smoothing=0.1", "warmup_epochs=1"]`` -> typed settings, by the field's default's type."""
    fields = Settings.__dataclass_fields__
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {pair}: {key} is not a setting")
        default = getattr(Settings(), key)
        out[key] = type(default)(value) if default is not None and not isinstance(default, bool) else \
            (value.lower() in ("1", "true", "yes") if isinstance(default, bool) else json.loads(value))
    return out


def run_seed(seed: int, recipe: dict, data: Path, folder: Path) -> dict:
    port = free_port()
    argvs = []
    for rank in range(2):
        settings = Settings(**recipe, data_dir=str(data), seed=seed, comm="none", threads=1, workers=0,
                            wandb="disabled", progress="off", backend="gloo", run_dir=str(folder), rank=rank,
                            world_size=2, master_addr="127.0.0.1", master_port=port)
        argvs.append(python("-m", "ddp_utils", "train", *settings.to_argv()))
    done = run_all(argvs, timeout=1800, env=base_env())
    if any(r.returncode for r in done):
        raise SystemExit(describe(done))
    results = json.loads((folder / "results.json").read_text())
    return {"seed": seed, "acc1": results["acc1"], "loss": results["loss"], "best_acc1": results["best_acc1"],
            "wall_time_s": results["wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="demo")
    parser.add_argument("--seeds", default="301-316", help="the seeds judged (default 301-316: 16 fresh ones)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting changed")
    add_out(parser, "recipe_spread")
    args = parser.parse_args()
    recorder = Recorder("recipe_spread", args)
    recipe = {**RECIPES[args.recipe], **overrides(args.set)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from ddp_utils.demo_data import prepare_demo
        prepare_demo(Path(tmp) / "demo")
        for seed in seeds(args.seeds):
            rows.append(run_seed(seed, recipe, Path(tmp) / "demo", Path(tmp) / f"run-{seed}"))
            print(f"seed {seed}: Acc@1 {rows[-1]['acc1']:.2f}, val loss {rows[-1]['loss']:.4f}", flush=True)
    acc = [r["acc1"] for r in rows]
    figures = {"recipe": args.recipe, "settings": recipe, "runs": rows, "acc1_mean": statistics.mean(acc),
               "acc1_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0, "acc1_min": min(acc), "acc1_max": max(acc),
               "loss_mean": statistics.mean(r["loss"] for r in rows), "sd_mark": SD_MARK}
    figures["meets_mark"] = figures["acc1_sd"] <= SD_MARK
    table = ["| recipe | seeds | Acc@1 mean | sd | lowest | highest | val loss mean |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| {args.recipe}{' ' + ' '.join(args.set) if args.set else ''} | {len(rows)} | "
             f"{figures['acc1_mean']:.2f} | {figures['acc1_sd']:.2f} | {figures['acc1_min']:.2f} | "
             f"{figures['acc1_max']:.2f} | {figures['loss_mean']:.4f} |"]
    print("\n".join(table))
    recorder.save(figures=figures, table=table)


if __name__ == "__main__":
    main()
