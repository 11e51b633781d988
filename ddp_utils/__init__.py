"""ddp_utils: multi-node PyTorch DDP training for notebooks and the command line.

The calls a notebook makes, in order (``# DDP:`` marks what a one-GPU script would not need)::

    settings = Settings(dataset="demo", world_size=2, rank=0, master_addr="10.0.0.1")
    ctx = setup(settings)                                   # DDP: pre-flight + process group
    data = build_data(settings, ctx.rank, ctx.world_size, ctx.device)
    agree(data.fingerprint(), ctx, what="data")             # DDP: same data on every node
    model = prepare_model(build_model(settings.arch, data.num_classes), settings, ctx)
    logger = make_logger(settings, ctx.rank)                # rank 0 writes, others get a NullLogger
    results = fit(settings, ctx, data, model, logger)
    teardown()                                              # DDP
"""

# The public API as ``ddp_utils.Settings`` / ``from ddp_utils import fit``, imported on first use so that
# ``import ddp_utils`` (and ``python -m ddp_utils --help``) does not load torch. ``preflight`` and ``run``
# are left out on purpose: they are also submodule names, and ``from ddp_utils import preflight`` must
# keep giving the module (use ``ddp_utils.preflight.preflight`` and ``ddp_utils.run.run``).
__all__ = ["Settings", "agree", "build_data", "build_model", "check_data", "evaluate", "fit", "make_logger",
           "prepare_demo", "prepare_model", "read_scalars", "session", "setup", "teardown", "unwrap"]
_FROM = {"settings": "Settings", "distributed": "setup teardown session agree",
         "data": "build_data check_data prepare_demo", "model": "build_model prepare_model unwrap",
         "runlog": "make_logger read_scalars", "train": "fit evaluate"}
_API = {name: module for module, names in _FROM.items() for name in names.split()}


def __getattr__(name):
    if name in _API:
        from importlib import import_module
        return getattr(import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
