"""Finished run folders in the format ``fit`` writes, with chosen figures (no training): the report's input."""
from __future__ import annotations

import json

from ddp_utils.settings import Settings


# -- run folders ---------------------------------------------------------------------------------
def fake_run(folder, world_size, train_time_s, epochs=2, acc1=50.0, images_per_epoch=900_000,
             device_name="Tesla T4", host="node0", *, batch_size=64, seed=None, shares=None, per_rank=None,
             link_gbit_s=None, predicted_speedup=None, gpu_util=None, parallel=None, loss=1.5, acc5=90.0,
             tensorboard=False):
    """A finished run folder in the format ``fit`` writes, with chosen times (no training).

    Without ``shares`` or ``per_rank`` it is an older kit's run (no time breakdown, no GPU use, no
    seed or parallel mode in results.json). ``shares``: {"data", "compute", "comm", "idle"} fractions
    of the train time (the ranks' mean); ``per_rank``: one such dict per rank (the mean is then
    theirs). ``tensorboard``: also TensorBoard scalars (train loss/acc1 and lr at every step, val
    per epoch), as the trainer logs them.
    """
    folder.mkdir(parents=True)
    settings = Settings(dataset="cinic10", arch="resnet18_cifar", epochs=epochs, batch_size=batch_size,
                        world_size=world_size, run_dir=str(folder), wandb="disabled", seed=seed or 0)
    settings_dict = settings.to_dict()
    if parallel is not None:
        settings_dict["parallel"] = parallel
    (folder / "settings.json").write_text(json.dumps(settings_dict, indent=2, sort_keys=True) + "\n")
    per_epoch = train_time_s / epochs
    gb = settings.global_batch_size
    steps_per_epoch = images_per_epoch // gb
    history = [{"epoch": e + 1,
                "train": {"loss": 2.0 - 0.3 * e, "acc1": 30.0 + 10 * e, "acc5": 70.0 + 5 * e,
                          "count": images_per_epoch, "epoch": e, "step": (e + 1) * steps_per_epoch,
                          "wall_s": per_epoch, "data_s": 0.1 * per_epoch, "compute_s": 0.9 * per_epoch,
                          "images_per_s": images_per_epoch / per_epoch,
                          "images_per_s_rank": images_per_epoch / per_epoch / world_size},
                "val": {"loss": 1.9 - 0.3 * e, "acc1": 35.0 + 10 * e, "acc5": 75.0 + 5 * e, "count": 500}}
               for e in range(epochs)]
    results = {"acc1": acc1, "acc5": acc5, "loss": loss, "best_acc1": acc1, "val_images": 500,
               "epochs": epochs, "epochs_run": epochs, "world_size": world_size,
               "global_batch_size": gb, "lr": settings.effective_lr,
               "wall_time_s": train_time_s + 10.0, "train_time_s": train_time_s,
               "images_per_s": images_per_epoch * epochs / train_time_s, "data_wait_fraction": 0.1,
               "dataset": "cinic10", "arch": "resnet18_cifar", "device": "cuda:0", "device_name": device_name,
               "backend": "nccl" if world_size > 1 else "none", "host": host, "cpus": 8,
               "history": history}
    if per_rank is not None or shares is not None:   # the new results.json keys (schema of issue 8)
        ranks = per_rank or [shares]
        results["per_rank"] = [{"rank": r, "host": f"node{r}", **{f"{k}_s": v * train_time_s for k, v in part.items()}}
                               for r, part in enumerate(ranks)] if per_rank else None
        mean = {k: sum(part[k] for part in ranks) / len(ranks) for k in ("data", "compute", "comm", "idle")}
        steps = steps_per_epoch * epochs
        results.update({f"{k}_s": v * train_time_s for k, v in mean.items()},
                       comm_total_s=2 * mean["comm"] * train_time_s, steps=steps,
                       measured_step_s=train_time_s / steps, link_gbit_s=link_gbit_s,
                       predicted_speedup=predicted_speedup, gpu_util=gpu_util if gpu_util is not None else "no GPU",
                       gpu_util_peak=None, gpu_mem_peak_mb=None, stopped_early=None, stop_reason=None,
                       parallel=parallel or ("ddp" if world_size > 1 else "none"), seed=seed or 0)
        if results["per_rank"] is None:
            del results["per_rank"]
        for h in history:
            h["train"].update(comm_s=mean["comm"] * per_epoch, idle_s=mean["idle"] * per_epoch,
                              comm_total_s=2 * mean["comm"] * per_epoch, lr=settings.effective_lr / (h["epoch"] + 1))
    elif seed is not None or parallel is not None or gpu_util is not None:
        results.update({k: v for k, v in (("seed", seed), ("parallel", parallel), ("gpu_util", gpu_util))
                        if v is not None})
    (folder / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(str(folder / "tb")) as writer:
            total = steps_per_epoch * epochs
            for step in range(1, total + 1):
                writer.add_scalar("lr", settings.effective_lr * (1 - step / total), step)
                writer.add_scalar("Loss/train", 2.0 - step / total, step)
                writer.add_scalar("acc1/train", 30.0 + 20 * step / total, step)
            for h in history:
                writer.add_scalar("Loss/val", h["val"]["loss"], h["train"]["step"])
                writer.add_scalar("acc1/val", h["val"]["acc1"], h["train"]["step"])
    return folder
