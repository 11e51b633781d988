"""Command line: ``python -m ddp_utils {train,launch,check,demo,report,compare,grade} ...``.

Two nodes, one GPU each (the commands differ only in --rank)::

    node0$ python -m ddp_utils train --dataset imagenet --data-dir /data/imagenet \\
               --master-addr 10.0.0.1 --master-port 29500 --world-size 2 --rank 0
    node1$ python -m ddp_utils train ... same flags ... --rank 1

One node with several GPUs: ``python -m ddp_utils launch --nproc-per-node 4 --dataset ...`` (one
``train`` process per GPU, torchrun's flag names), or ``torchrun --nproc-per-node 4 -m ddp_utils train
--dataset ...`` (rank, world size and master come from torchrun's environment).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from ..robust import peers
from .. import settings as settings_module
from ..robust.guard import RunGuard, Terminated

# Errors answered with exit 2 and their paragraph (with the traceback too when neither the kit raised them nor they
# are a bad value or a missing or existing file): OSError is also a disk or folder the kit did not foresee.
CLEAR_ERRORS = (ValueError, OSError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    """``python -m ddp_utils``'s commands, each with its flags."""
    parser = argparse.ArgumentParser(prog="python -m ddp_utils", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_launch(sub)
    _add_check_and_demo(sub)
    _add_report(sub)
    _add_grade(sub)
    return parser


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train (or evaluate) on this rank; start one per rank")
    settings_module.add_arguments(train)
    train.add_argument("--resume", metavar="PATH|auto", help="continue from a checkpoint (last.pt) on rank 0; "
                                                              "other ranks receive it over the network. auto: "
                                                              "continue the unfinished run with these settings if "
                                                              "rank 0 has one (the --run-dir, else the newest "
                                                              "matching folder next to it), else start a new run")
    train.add_argument("--evaluate", action="store_true", help="only evaluate the --resume checkpoint")
    train.add_argument("--seeds", type=seed_list, metavar="2,4,42",
                       help="train the same configuration once per seed, one after the other, into sibling "
                            "run folders RUN_DIR-seed2, RUN_DIR-seed4, ...; `report` then gives mean +- std")
    train.add_argument("--grid", action="append", metavar="NAME=V1,V2", default=None,
                       help="vary a setting: one run per value (per combination when given again, e.g. --grid "
                            "bucket_mb=1,25,100 --grid comm=none,fp16), one after the other, into sibling run "
                            "folders RUN_DIR-bucket_mb1-commnone, ...; short runs with --max-steps-per-epoch; "
                            "`report` then makes one table and grid.png")


def _add_launch(sub) -> None:
    launch = sub.add_parser("launch", help="start one train process per GPU of this node (N CPU processes with "
                                           "--nproc-per-node N), rank 0's output streamed; torchrun's flag names")
    launch.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                        help="processes on this node (default: its GPUs, 1 without a GPU)")
    launch.add_argument("--nnodes", type=int, default=1, help="nodes in the job, each running this command (default 1)")
    launch.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's index, 0..nnodes-1; 0 on the node whose IP is --master-addr (default 0)")
    launch.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
                        help="torchrun restarts every process of the job up to N times after a failure; with "
                             "--resume auto the run continues from its last checkpoint (default 0)")
    launch.add_argument("--log-dir", default=None, help="folder for every rank's output, rank<N>.log (default: a "
                                                        "new temporary folder, named when the run starts)")
    settings_module.add_arguments(launch)   # --master-addr, --master-port and every train flag
    launch.add_argument("--resume", metavar="PATH|auto", help="as for train (every process gets it)")
    launch.add_argument("--evaluate", action="store_true", help="as for train")
    launch.add_argument("--seeds", type=seed_list, metavar="2,4,42", help="as for train")
    launch.add_argument("--grid", action="append", metavar="NAME=V1,V2", default=None, help="as for train")


def _add_check_and_demo(sub) -> None:
    check = sub.add_parser("check", help="pre-flight only: network, port, GPUs, data, /dev/shm; exit 0 when ready")
    settings_module.add_arguments(check)
    check.add_argument("--verify-images", action="store_true",
                       help="decode every image of the train and validation splits (all cores, with a progress "
                            "bar); without it a split of more than 20,000 images has one image per class checked")

    demo = sub.add_parser("demo", help="2 ranks on localhost vs 1 process on the bundled demo set, "
                                       "then a comparison table (CPU, a few minutes)")
    demo.add_argument("--epochs", type=int, default=None, help="epochs per run (default: the demo's)")
    demo.add_argument("--world-size", type=int, default=2, help="ranks for the DDP run (default 2)")
    demo.add_argument("--run-dir", default="runs/demo", help="parent folder of the runs (default runs/demo)")
    demo.add_argument("--master-port", type=int, default=0, help="port on localhost (default: a free one)")
    demo.add_argument("--price-per-hour", type=float, default=0.0,
                      help="what a node costs per hour: the table then shows what each run cost (default: not set)")


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="results table (Markdown) and labelled figures from finished run folders")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding results.json")
    where = report.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", default=None,
                       help="folder for results.md, curves.png, time.png, throughput.png: a new or an empty one, "
                            "so that a report never replaces a file (default: a new folder "
                            "reports/<YYYYmmdd-HHMMSS>/ under the current directory)")
    where.add_argument("--kit-images", action="store_true",
                       help="write into the kit's own images/ folder, replacing its committed example "
                            "pictures: the one way to regenerate them (a plain --out images/ is refused)")
    report.add_argument("--baseline", metavar="RUN_DIR", default=None,
                        help="run to measure speed-up against (default: the first 1-rank run)")

    compare = sub.add_parser("compare", help="single vs DataParallel vs DDP: one row per parallel mode, "
                                             "mean +- std over the seeds given (a Markdown table)")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                         help="run folders holding results.json, e.g. every seed of each mode")


def _add_grade(sub) -> None:
    grade = sub.add_parser("grade", help="for instructors: a student's hand-in checked (the lab's tests on a copy of "
                                         "student.py, the table against the run folders) into sheet.md and sheet.json")
    grade.add_argument("handin", metavar="HANDIN", help="the folder of one student's hand-in (its layout: "
                                                        "lab/instructors.md)")
    grade.add_argument("--tests", metavar="PATH", default=None,
                       help="the instructor's hidden tests, a .py file or a folder of them, run beside the lab's")
    grade.add_argument("--out", metavar="DIR", default=None,
                       help="folder for the sheet: a new or an empty one (default: a new grades/<HANDIN>/<time>/)")
    grade.add_argument("--time-limit", type=float, default=None, metavar="S",
                       help="seconds the lab's tests may take in all before they are stopped (default 600)")
    grade.add_argument("--world-sizes", type=world_sizes, metavar="2,3,4", default=None,
                       help="run the lab's tests on these numbers of ranks only (default: all of them)")
    grade.add_argument("-k", metavar="EXPR", default=None, help="pytest's -k: only the lab's tests it selects")
    grade.add_argument("--dataset", metavar="NAME", default=None,
                       help="the data set every run must have trained (default: any, the same for all)")


def world_sizes(text: str) -> list[int]:
    """``"2,3"`` -> ``[2, 3]``: numbers of ranks, each at least 1."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of ranks separated by commas, e.g. 2,3")
    return sizes


def seed_list(text: str) -> list[int]:
    """``"2,4,42"`` -> ``[2, 4, 42]``; distinct integers, at least one."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seeds as integers separated by commas, e.g. 2,4,42") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more different seeds, e.g. 2,4,42")
    return seeds


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # signals, a stop Python drops, the cause told to the others, fd 2: set and put back by the guard alone
    with RunGuard(sigterm=True) as run:
        return _command(args, run)


def _command(args, run: RunGuard) -> int:
    try:
        if args.command == "train":
            from ..job import grid_axes, run_grid, run_job, run_seeds
            if args.grid:
                if args.resume or args.seeds or args.evaluate:
                    raise ValueError("--grid starts new runs, one per value: without --resume, --seeds or --evaluate "
                                     "(continue one of its runs with --resume RUN_DIR-<name><value>/last.pt and that "
                                     "value set)")
                run_grid(settings_module.from_args(args), grid_axes(args.grid))
            elif args.seeds:
                if args.resume:
                    raise ValueError("--seeds starts new runs; to continue one seed's run, pass --resume "
                                     "RUN_DIR-seedN/last.pt with --seed N instead of --seeds")
                run_seeds(settings_module.from_args(args), args.seeds)
            else:
                run_job(settings_module.from_args(args), resume=args.resume, evaluate=args.evaluate)
        elif args.command == "launch":
            from .launch import main as launch_main
            return launch_main(args)
        elif args.command == "check":
            from .check import run_check
            return 0 if run_check(settings_module.from_args(args), verify_images=args.verify_images) else 1
        elif args.command == "demo":
            from .demo import run_demo
            run_demo(epochs=args.epochs, world_size=args.world_size, run_dir=args.run_dir, port=args.master_port,
                     price_per_hour=args.price_per_hour)
        elif args.command == "report":
            from .report import report_dir, results_table, write_report
            out = report_dir(args.out, kit_images=args.kit_images)   # a refusal comes before any output
            print(results_table(args.run_dirs, baseline=args.baseline))
            for path in write_report(args.run_dirs, out, baseline=args.baseline, kit_images=args.kit_images):
                print(f"wrote {path}")
        elif args.command == "grade":
            from .grade import grade_command
            return grade_command(args)
        elif args.command == "compare":
            from .report import compare_table
            print(compare_table(args.run_dirs))
        return 0
    except KeyboardInterrupt as exc:
        return _stopped(exc)
    except CLEAR_ERRORS as exc:
        if peers.stop_signal:   # what broke after a signal whose exception Python dropped: the signal
            return _stopped(run.stop())
        if not isinstance(exc, (ValueError, FileExistsError, FileNotFoundError)) and not _is_ours(exc):
            traceback.print_exc()
        print(f"\nerror: {exc}", file=sys.stderr)
        _tell_torchrun(exc)
        return 2


def _stopped(exc: KeyboardInterrupt) -> int:
    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    # what exists: the run's own sentence (job.what_exists), else (a stop outside a run) only what may
    kept = getattr(exc, "kept", None) or ("if an epoch finished, its checkpoint is last.pt in the run folder: "
                                          "continue with --resume RUN_DIR/last.pt")
    with contextlib.suppress(OSError):   # the terminal (or the launcher reading our output) may be gone
        print(f"\n{what}: the process group was torn down and the other ranks were told; {kept}.", file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


def _tell_torchrun(exc: BaseException) -> None:
    """Under torchrun, the error file its summary reads ("Root Cause ... message"): the kit's paragraph, not
    "Signal/exit code 2, error_file: <N/A>". What torch's ``@record`` writes, for an error the kit handled."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        with contextlib.suppress(OSError):
            get_error_handler().record_exception(exc)


def _is_ours(exc: BaseException) -> bool:
    """Errors raised by the kit itself (their text is already the explanation)."""
    return type(exc).__module__.startswith("ddp_utils")
