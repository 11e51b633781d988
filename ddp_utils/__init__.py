"""ddp_utils: multi-node PyTorch DDP training for notebooks and the command line.

The calls a notebook makes, in order (``# DDP:`` marks what a one-GPU script would not need)::

    settings = Settings(dataset="demo", world_size=2, rank=0, master_addr="10.0.0.1")
    ctx = setup(settings)                      # DDP: join the process group (init_process_group)
    data = build_data(settings, ctx)           # DDP: this rank's share of the data (DistributedSampler)
    model = build_model(settings.arch, data.num_classes, settings.seed, data.image_size)
    model = prepare_model(model, settings, ctx)
                                               # DDP: DistributedDataParallel(model)
    job = open_run(settings, ctx, data, model) # DDP: rank 0 writes the run folder, the others do not
    with job:                                  # closes the logs; after an error also leaves the group
        results = fit(job)                     # train, evaluate exactly, checkpoint; the same on every rank
    teardown()                                 # DDP: leave the process group

``prepare(settings)`` makes the same calls in one (job.py): the command line (``python -m ddp_utils
train``), the labs and the benchmarks use it. The lesson is the modules directly in this folder;
``robust/`` (below it: what real nodes need), ``speed/`` (plugged into it) and ``tools/`` (on top: the commands)
hold the rest; ``lint-imports`` (.importlinter) keeps them in that order.
"""
# The options plug into the core's tables (loaders, gradient communication, parallel modes, observers) when their
# modules load. Loading them here, where the package is put together, means every way into the kit (a notebook,
# the command line, a test importing ddp_utils.train) sees the same tables; the core itself never imports speed/.
from . import concerns, data  # noqa: E402,F401 - the core's own rows (observers, the workers loader) come first
from . import speed  # noqa: E402,F401
from .loaders import check_presets  # noqa: E402

check_presets()   # every preset's not_for names a loader that registered: a typo fails here, at import

# The public API as ``ddp_utils.Settings`` / ``from ddp_utils import fit``, imported on first use.
__all__ = ["Settings", "agree", "build_data", "build_loaders", "build_model", "check_data", "describe_batch", "evaluate", "fit",
           "make_logger", "open_run", "prepare", "prepare_demo", "prepare_model", "read_scalars", "run_job", "session",
           "setup", "teardown", "unwrap"]
_FROM = {"settings": "Settings describe_batch", "distributed": "setup teardown session agree",
         "data": "build_data build_loaders", "datasets": "check_data", "demo_data": "prepare_demo",
         "model": "build_model prepare_model unwrap", "runlog": "make_logger read_scalars",
         "train": "fit evaluate", "job": "open_run prepare run_job"}
_API = {name: module for module, names in _FROM.items() for name in names.split()}


def __getattr__(name):
    if name in _API:
        from importlib import import_module
        return getattr(import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
