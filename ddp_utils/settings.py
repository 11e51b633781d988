"""One frozen settings object for a run: what to train, how, and where the other ranks are.

Build it from keyword arguments (notebooks), from the command line (``python -m ddp_utils train``)
or from the variables torchrun sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``). It is saved as ``settings.json`` in every run folder and inside every checkpoint.
Defaults are laptop-friendly: the ``demo`` data set on CPU, one process. The model, batch, epochs,
warm-up and lr that are not given come from the data set's recipe (``presets.py``), so every preset
learns at its defaults; the resolved values are what settings.json and every checkpoint hold.
``Settings.to_argv()`` is the one place that turns settings back into command-line flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from .architectures import ARCHITECTURES, architecture
from .communication import COMMS, describe_comms
from .loaders import LOADERS, describe_loaders
from .parallel import MODES, describe_modes
from .presets import LR_REFERENCE_BATCH, PRESETS, default_of
from .slurm import first_host

DATASETS = PRESETS.keys()   # live: a preset added to PRESETS (a test's) is a choice too
BACKENDS = ("auto", "gloo", "nccl")
AMP_MODES = ("auto", "bf16", "fp16", "off")
WANDB_MODES = ("auto", "online", "offline", "disabled")
PROGRESS_MODES = ("auto", "steps", "bar", "off")
WARMUP_PRECISIONS = ("fp32", "bf16")

# The fields a preset's recipe fills in when they are left out (None); a model whose registry entry pairs it with
# another optimizer (architectures.py) brings that optimizer, its lr and its weight decay.
RECIPE_FIELDS = ("arch", "batch_size", "epochs", "lr", "warmup_epochs", "optimizer", "weight_decay")
OPTIMIZERS = ("sgd", "adamw")

# Each field's facts live in its own declaration (``_f``): its help text (the flag's and the docs'), its section
# (``--help`` groups the flags by it), its bound, and whether every rank must share it. MUST_AGREE and the checks
# in ``Settings.problems`` are read from there (below the class), so a new setting is one edit. The choices (and
# help) of --loader, --comm and --parallel are read from the tables the modules that implement them fill
# (loaders.py, communication.py, parallel.py): functions here, called when they are needed.
SECTIONS = DATA, MODEL, OPTIMISATION, SPEED, OUTPUT, DISTRIBUTED = ("data", "model", "optimisation", "speed", "output",
                                                                   "distributed")
POSITIVE, NOT_NEGATIVE = "positive", "not negative"   # a number's bound, said as "must be positive"


def _f(default, help: str, section: str, bound: str | None = None, agree: bool = False, **kw):
    """A settings field and its facts: ``help`` feeds the command line and the docs; ``section`` groups it;
    ``bound`` (POSITIVE or NOT_NEGATIVE) is checked; ``agree``: every rank must have the same value, or the ranks
    would silently train different things (``distributed.setup`` compares them)."""
    assert section in SECTIONS and bound in (None, POSITIVE, NOT_NEGATIVE), (section, bound)
    return field(default=default, metadata={"help": help, "section": section, "bound": bound, "agree": agree, **kw})


@dataclass(frozen=True)
class Settings:
    # -- data ---------------------------------------------------------------------------------
    dataset: str = _f("demo", f"data preset: {', '.join(PRESETS)} ("
                              f"{', '.join(n for n, p in PRESETS.items() if p.made_here)} made by the kit)",
                      choices=DATASETS, section=DATA, agree=True)
    data_dir: str = _f("data/demo", "folder holding the preset's split folders (train/, val/ or valid/)", section=DATA)
    val_split: str = _f("", f"split to evaluate on; empty = the preset's ({default_of('val_split')})", section=DATA)
    image_size: int = _f(0, f"training crop in pixels; 0 = the preset's ({default_of('image_size')})",
                         section=DATA, bound=NOT_NEGATIVE, agree=True)
    workers: int = _f(2, "DataLoader worker processes per rank (the course used 2 per GPU)",
                      section=DATA, bound=NOT_NEGATIVE)
    # Not in MUST_AGREE, like workers: every loader gives a rank the same shard, steps and
    # validation tensors; only the random crop/flip draws differ, and those differ per rank anyway.
    loader: str = _f("workers", describe_loaders, choices=lambda: ("auto", *LOADERS), section=DATA)
    # -- model --------------------------------------------------------------------------------
    arch: str = _f(None, "; ".join(f"{name} ({entry.about})" for name, entry in ARCHITECTURES.items()) +
                   "; or any torchvision classifier name such as resnet18, resnet50; default: the preset's recipe",
                   type=str, section=MODEL, agree=True)
    sync_bn: bool = _f(False, "convert BatchNorm to SyncBatchNorm so statistics use the global batch",
                       section=MODEL, agree=True)
    # -- optimisation -------------------------------------------------------------------------
    epochs: int = _f(None, "passes over the training split; default: the preset's recipe", type=int,
                     section=OPTIMISATION, bound=POSITIVE, agree=True)
    batch_size: int = _f(None, "images per rank per step (the global batch is this times world_size, times "
                               "accumulate); default: the preset's recipe", type=int,
                         section=OPTIMISATION, bound=POSITIVE, agree=True)
    lr: float = _f(None, "learning rate at lr_reference_batch images, scaled to the real global batch "
                         "(see scale_lr); default: the preset's recipe", type=float,
                   section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    scale_lr: bool = _f(True, "scale lr linearly with the global batch: lr * global_batch / lr_reference_batch",
                        section=OPTIMISATION, agree=True)
    lr_reference_batch: int = _f(LR_REFERENCE_BATCH, "global batch at which lr is given (Goyal et al. use 256)",
                                 section=OPTIMISATION, bound=POSITIVE, agree=True)
    warmup_epochs: float = _f(None, "linear warm-up length before the cosine decay, in epochs; default: "
                                    "the preset's recipe", type=float,
                              section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    optimizer: str = _f(None, "sgd (with momentum) or adamw; default: the model's (a ViT's adamw) or the preset's "
                              "recipe", choices=OPTIMIZERS, type=str, section=OPTIMISATION, agree=True)
    momentum: float = _f(0.9, "SGD momentum", section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    weight_decay: float = _f(None, "weight decay (not applied to norm layers, biases and what the model's registry "
                                   "entry exempts); default: the model's optimizer's or the preset's recipe",
                             type=float, section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    max_steps_per_epoch: int = _f(0, "stop each epoch after this many steps; 0 = the whole split",
                                  section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    patience: int = _f(0, "early stopping: stop after this many epochs without a better validation Acc@1 "
                          "(best.pt keeps the best epoch); 0 = train every epoch",
                       section=OPTIMISATION, bound=NOT_NEGATIVE, agree=True)
    seed: int = _f(0, "seed for weights, shuffling and augmentation; same on every rank",
                   section=OPTIMISATION, agree=True)
    # -- speed --------------------------------------------------------------------------------
    amp: str = _f("auto", "mixed precision: auto (bf16 on GPUs that have it, fp16 + grad scaler on "
                          "others, off on CPU), bf16, fp16 or off", choices=AMP_MODES, section=SPEED)
    channels_last: bool = _f(True, "NHWC memory layout on GPU (faster convolutions; ignored on CPU)", section=SPEED)
    compile: bool = _f(False, "torch.compile the model (first steps are slow while it compiles)", section=SPEED)
    threads: int = _f(0, "CPU threads per process; 0 = this machine's cores / the ranks on it, so that "
                         "ranks sharing a machine do not fight over its cores (OMP_NUM_THREADS wins if set)",
                      section=SPEED, bound=NOT_NEGATIVE)
    # -- output -------------------------------------------------------------------------------
    run_dir: str = _f("", "folder for logs, TensorBoard, checkpoints; empty = runs/<dataset>-<arch>-ws<N>-<time>",
                      section=OUTPUT)
    wandb: str = _f("auto", "Weights & Biases: auto (online if a key is set up, else offline), online, "
                            "offline or disabled", choices=WANDB_MODES, section=OUTPUT)
    wandb_project: str = _f("ddp-course", "W&B project name", section=OUTPUT)
    log_every: int = _f(20, "steps between TensorBoard scalars on rank 0", section=OUTPUT, bound=POSITIVE)
    profile_steps: str = _f("", "A:B: trace training steps A to B-1 (counted from 0 over the run) with torch.profiler on "
                                "every rank, written to RUN_DIR/profile/rank<N>.pt.trace.json (Perfetto, "
                                "chrome://tracing); empty = no trace", section=OUTPUT, agree=True)
    progress: str = _f("auto", "auto: a progress bar on a terminal or in Jupyter, two lines per epoch when the "
                               "output is piped; steps: also a line every log_every steps; bar; off",
                       choices=PROGRESS_MODES, section=OUTPUT)
    price_per_hour: float = _f(0.0, "what one node costs per hour (any currency, e.g. 0.752 for an AWS g4dn.2xlarge "
                                    "in USD, on demand in us-east-1); results then give the cost of the run "
                                    "and of each epoch for all nodes together; 0 = not set, no cost",
                               section=OUTPUT, bound=NOT_NEGATIVE)
    # -- distributed --------------------------------------------------------------------------
    parallel: str = _f("ddp", lambda: describe_modes() + " (docs/zero-fsdp.md). With one process a mode that shards "
                                                       "has nothing to shard: plain training",
                       choices=lambda: tuple(MODES), section=DISTRIBUTED, agree=True)
    link_probe: bool = _f(True, "before training, time a few all-reduces of the gradients' size and one "
                                "step's compute: link bandwidth and predicted speed-up (a few seconds)",
                          section=DISTRIBUTED, agree=True)
    comm: str = _f("none", lambda: f"gradient communication: {describe_comms()}, or auto (from the link probe: half "
                                   f"precision when communication would take more than comm_auto_share of a step; "
                                   f"never powersgd or localsgd, which trade accuracy: by name only)",
                   choices=lambda: ("auto", *COMMS), section=DISTRIBUTED, agree=True)
    build_ddp: str = _f("", "train with what you wrote in lab/build_ddp (student.py; BUILD_DDP=reference: the kit's "
                            "solution) instead of torch's: a (all-reduce every gradient after backward), b (one "
                            "async all-reduce per parameter from hooks), c (buckets of bucket_mb) in place of "
                            "DistributedDataParallel; f (your ShardedOptimizer as ZeRO-1's, beside torch's DDP); "
                            "empty: torch's", choices=("", "a", "b", "c", "f"), section=DISTRIBUTED, agree=True)
    bucket_mb: float = _f(25.0, "DDP gradient bucket size in MB (DDP's default 25): smaller buckets start the "
                                "all-reduce earlier in the backward pass, larger ones make fewer, longer messages",
                          section=DISTRIBUTED, bound=POSITIVE, agree=True)
    accumulate: int = _f(1, "gradient accumulation: add up the gradients of this many steps and all-reduce "
                            "once (DDP's no_sync for the others): 1/accumulate of the traffic, but a global batch "
                            "accumulate times larger (lr scales with it) and fewer optimizer steps", type=int,
                         section=DISTRIBUTED, bound=POSITIVE, agree=True)
    static_graph: bool = _f(False, "tell DDP the model runs the same layers every step (lets it skip per-step "
                                   "bookkeeping and overlap better); wrong for models with data-dependent branches",
                            section=DISTRIBUTED, agree=True)
    find_unused_parameters: bool = _f(False, "let DDP train a model whose forward leaves some parameters unused "
                                             "(a branch not taken, a spare head): DDP then walks the autograd graph "
                                             "after every forward to find them (torch: an extra traversal every "
                                             "step, which can slow it); off, the kit stops at the first step naming "
                                             "them", section=DISTRIBUTED, agree=True)
    powersgd_rank: int = _f(4, "PowerSGD: rank of the low-rank approximation (higher = closer to exact, more bytes)",
                            section=DISTRIBUTED, bound=POSITIVE, agree=True)
    powersgd_warmup_steps: int = _f(0, "PowerSGD: steps of exact fp32 all-reduce before compressing (the start of "
                                       "training is the most sensitive to inexact gradients); 0: a quarter of the "
                                       "run's optimizer steps (PyTorch advises a tenth and more until the accuracy "
                                       "is kept: docs/benchmarks.md has the kit's studies), at least 10 and at most "
                                       "1000", section=DISTRIBUTED, bound=NOT_NEGATIVE, agree=True)
    powersgd_warmup_precision: str = _f("fp32", "PowerSGD: how its warm-up steps send the gradients: fp32 (exact, "
                                                "PyTorch's) or bf16 (half the bytes, each gradient rounded to bf16's "
                                                "8 bits of mantissa)", choices=WARMUP_PRECISIONS,
                                        section=DISTRIBUTED, agree=True)
    powersgd_min_compression: float = _f(4.0, "PowerSGD: send a gradient exact unless its approximation is at least "
                                              "this many times smaller (PyTorch's min_compression_rate, 2 there): a "
                                              "small classifier costs few bytes exact and loses the most compressed",
                                         section=DISTRIBUTED, bound=POSITIVE, agree=True)
    average_every: int = _f(8, "localsgd: average the weights over the ranks every this many optimizer steps "
                               "(1/average_every of the traffic; the ranks drift apart in between)", type=int,
                            section=DISTRIBUTED, bound=POSITIVE, agree=True)
    localsgd_warmup_steps: int = _f(8, "localsgd: optimizer steps of plain DDP (gradients all-reduced) before the "
                                       "ranks step on their own", type=int,
                                    section=DISTRIBUTED, bound=NOT_NEGATIVE, agree=True)
    comm_auto_share: float = _f(0.2, "comm=auto: send half-precision gradients when the probe predicts "
                                     "communication above this share of a step", section=DISTRIBUTED,
                                bound=NOT_NEGATIVE, agree=True)
    auto_local_sgd: bool = _f(False, "kept for old command lines; changes nothing: comm=auto never chooses local "
                                     "SGD (another algorithm: a few points of Acc@1 in the benchmarks), choose it "
                                     "by name, comm=localsgd", section=DISTRIBUTED, agree=True)
    master_addr: str = _f("127.0.0.1", "IP of the rank-0 node: its private IP on a cloud network", section=DISTRIBUTED)
    master_port: int = _f(29500, "TCP port rank 0 listens on; open it (and the ports NCCL/Gloo add) "
                                 "between the nodes", section=DISTRIBUTED, agree=True)
    rank: int = _f(0, "this process's rank: 0 on the master, 1..world_size-1 on the others", section=DISTRIBUTED)
    world_size: int = _f(1, "number of processes in the job (2 for two nodes with one GPU each)",
                         section=DISTRIBUTED, agree=True)
    local_rank: int = _f(0, "GPU index on this node (torchrun sets LOCAL_RANK)",
                         section=DISTRIBUTED, bound=NOT_NEGATIVE)
    backend: str = _f("auto", "auto (nccl when this rank has a GPU, else gloo), gloo or nccl",
                      choices=BACKENDS, section=DISTRIBUTED)
    init_timeout: float = _f(300.0, "seconds to wait for the other ranks at start-up (joining, reading "
                                    "the data, rank 0 starting W&B or writing a checkpoint) before failing",
                             section=DISTRIBUTED, bound=POSITIVE)
    collective_timeout: float = _f(60.0, "seconds a collective may wait during training before this rank "
                                         "stops and names the rank that went silent",
                                   section=DISTRIBUTED, bound=POSITIVE)
    socket_ifname: str = _f("", "network interface for NCCL/Gloo traffic; empty = the one that routes "
                                "to master_addr (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win if set)",
                            section=DISTRIBUTED)
    init_method: str = _f("tcp", "tcp (tcp://master_addr:master_port) or env (under torchrun, whose "
                                 "agent already holds the port)", choices=("tcp", "env"), section=DISTRIBUTED)

    # ---------------------------------------------------------------------------------------
    def __post_init__(self):
        # Fill what was left out from the preset's recipe (frozen: hence object.__setattr__).
        for f in fields(self):   # a notebook's pathlib.Path for a folder is the text of that path; EPOCHS = 2.0 is 2
            value = getattr(self, f.name)
            if _kind(f) is str and isinstance(value, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(value))
            elif _kind(f) is int and isinstance(value, float) and value.is_integer():
                object.__setattr__(self, f.name, int(value))
        recipe = PRESETS[self.dataset if self.dataset in PRESETS else "demo"].recipe
        if self.arch is None:
            object.__setattr__(self, "arch", recipe.arch)
        paired = self._paired_optimizer()   # the model's own optimizer, lr and weight decay, if it has them
        for name in RECIPE_FIELDS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, paired.get(name, getattr(recipe, name)))
        problems = self.problems()
        if problems:
            raise ValueError("Invalid settings:\n  - " + "\n  - ".join(problems))

    def _paired_optimizer(self) -> dict:
        """What the model's registry entry says to train it with, where it is not the recipe's; {} for the rest
        (an unknown arch, said by ``problems``)."""
        try:
            entry = architecture(self.arch) if isinstance(self.arch, str) else None
        except ValueError:
            return {}
        if entry is None or entry.optimizer is None or self.optimizer not in (None, entry.optimizer):
            return {}
        return {"optimizer": entry.optimizer, "lr": entry.lr, "weight_decay": entry.weight_decay}

    def problems(self) -> list[str]:
        """Every inconsistency in these settings, phrased as what is wrong and what to do."""
        out = []
        for f in fields(self):
            choices = _choices(f)
            if choices and getattr(self, f.name) not in choices:
                out.append(f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        # A value typed into a notebook (MAX_STEPS = None, EPOCHS = "2", COMPILE = "no") gets a sentence, not a
        # TypeError, nor a truthy string taken for True
        mistyped = [_mistyped(f, getattr(self, f.name)) for f in fields(self)]
        if any(mistyped):
            return out + [m for m in mistyped if m]
        if self.world_size < 1:
            out.append(f"world_size={self.world_size}: must be at least 1")
        if not 0 <= self.rank < max(self.world_size, 1):
            out.append(f"rank={self.rank} with world_size={self.world_size}: rank must be in "
                       f"0..{self.world_size - 1} (0 on the master node)")
        if not 1 <= self.master_port <= 65535:
            out.append(f"master_port={self.master_port}: must be a TCP port, 1..65535 (e.g. 29500)")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["bound"] == POSITIVE and value <= 0:
                out.append(f"{f.name}={value}: must be positive")
            elif f.metadata["bound"] == NOT_NEGATIVE and value < 0:
                out.append(f"{f.name}={value}: must not be negative")
        out += self._combination_problems()
        window = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(self.profile_steps))
        if str(self.profile_steps).strip() and not (window and int(window[1]) < int(window[2])):
            out.append(f"profile_steps={self.profile_steps!r}: write A:B with A < B, the training steps to trace "
                       f"(e.g. 20:25 traces steps 20 to 24), or leave it empty")
        if not str(self.master_addr).strip():
            out.append("master_addr is empty: set it to the master node's IP address")
        out += self._model_problems()
        return out

    def _combination_problems(self) -> list[str]:
        """Settings that each work alone but not together."""
        out = []
        # Accumulation and local SGD train under DDP's no_sync() (comm=auto never picks localsgd).
        under_no_sync = (f"accumulate={self.accumulate}" if self.accumulate > 1 else
                         "comm=localsgd" if self.comm == "localsgd" else None)
        if under_no_sync and self.static_graph:
            out.append(f"{under_no_sync} with static_graph: DDP(static_graph=True) under no_sync() crashes or "
                       f"silently stops all-reducing in current PyTorch (pytorch/pytorch#187732): drop static_graph, "
                       f"or use accumulate=1 and another comm")
        if self.parallel in ("dp", "none") and self.world_size > 1:
            out.append(f"parallel={self.parallel} runs one process, but world_size={self.world_size}: use "
                       f"parallel=ddp for several processes, or world_size=1")
        ddp_only = ([f"comm={self.comm}"] * (self.comm != "none") + ["static_graph"] * self.static_graph
                    + ["find_unused_parameters"] * self.find_unused_parameters)
        if self.parallel == "fsdp" and ddp_only:   # FSDP has no DDP wrapper to hook into
            out.append(f"{' and '.join(ddp_only)} with parallel=fsdp: these set how DDP sends the gradients, and FSDP "
                       f"reduce-scatters them itself (a parameter no forward uses keeps its value): use comm=none "
                       f"without static_graph or find_unused_parameters, or parallel=ddp or zero1")
        if self.parallel == "zero1" and self.comm == "localsgd":
            out.append("comm=localsgd with parallel=zero1: local SGD averages every rank's whole optimizer state, "
                       "which ZeRO-1 splits between the ranks: use another comm, or parallel=ddp")
        if self.build_ddp in ("a", "b", "c") and (self.comm != "none" or self.accumulate > 1 or self.parallel != "ddp"):
            out.append(f"build_ddp={self.build_ddp!r} trains with your own DDP, which has no comm hooks, and the kit's "
                       f"loop times its finish_gradient_sync() for one backward pass a step: use it with comm=none, "
                       f"accumulate=1 and parallel=ddp")
        if self.build_ddp == "f" and (self.parallel != "ddp" or self.comm == "localsgd"):
            out.append("build_ddp='f' runs ZeRO-1 with your ShardedOptimizer beside torch's DDP: use it with "
                       "parallel=ddp (the run is then zero1's) and without local SGD")
        return out

    def _model_problems(self) -> list[str]:
        """An arch the kit cannot build, or one that cannot take the images it would be given."""
        if self.dataset not in PRESETS or not isinstance(self.arch, str):
            return []
        try:
            entry = architecture(self.arch)
        except ValueError as e:
            return [str(e)]
        refusal = entry.refusal(self.arch, self.image_size or PRESETS[self.dataset].image_size)
        return [refusal] if refusal else []

    # -- derived values (computed, never stored, so they cannot go stale) ---------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def global_batch_size(self) -> int:
        """Images per optimizer step, over all ranks and accumulated steps."""
        return self.batch_size * self.world_size * self.accumulate

    @property
    def effective_lr(self) -> float:
        """The lr the optimiser really uses: scaled with the global batch when scale_lr is set."""
        if self.scale_lr:
            return self.lr * self.global_batch_size / self.lr_reference_batch
        return self.lr

    @property
    def url(self) -> str:
        return "env://" if self.init_method == "env" else f"tcp://{self.master_addr}:{self.master_port}"

    def agreed(self) -> dict[str, Any]:
        """The values every rank must share (the fields declared with ``agree=True``), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["agree"]}

    # -- conversions -------------------------------------------------------------------------
    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_argv(self, skip=(), always=(), every=False) -> list[str]:
        """These settings as ``python -m ddp_utils train`` flags: ``["--dataset", "demo", ...]``.

        Flags appear for the values that differ from the field defaults (recipe values always, so the
        command reproduces the run even if a recipe changes later), for the fields in ``always``, or
        for every field with ``every``. ``skip`` leaves fields out (say ``("rank",)`` for a command
        shared by every node).
        """
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in skip or (not every and value == f.default and f.name not in always):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        return argv

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Settings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown setting(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "Settings":
        """Settings from torchrun's variables (when present) plus keyword overrides.

        Under torchrun (``TORCHELASTIC_RUN_ID`` set) its agent already listens on MASTER_PORT,
        so the process group joins that store with ``env://`` instead of binding the port again.
        Under ``srun`` (no ``RANK``, but ``SLURM_PROCID``) rank, world size and local rank come from
        ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, and the master from ``MASTER_ADDR`` or the
        first host of ``SLURM_JOB_NODELIST`` (slurm.py); the kit's own tcp store is used.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var, name, kind in (("MASTER_ADDR", "master_addr", str), ("MASTER_PORT", "master_port", int),
                                ("RANK", "rank", int), ("WORLD_SIZE", "world_size", int),
                                ("LOCAL_RANK", "local_rank", int)):
            if env.get(var, "") != "":
                try:
                    values[name] = kind(env[var])
                except ValueError:
                    raise ValueError(f"Environment variable {var}={env[var]!r} is not a valid {name}") from None
        if env.get("TORCHELASTIC_RUN_ID"):
            values["init_method"] = "env"
        elif "rank" not in values and env.get("SLURM_PROCID", "") != "":   # srun: one task per GPU
            for var, name in (("SLURM_PROCID", "rank"), ("SLURM_NTASKS", "world_size"),
                              ("SLURM_LOCALID", "local_rank")):
                if name not in values and env.get(var, "") != "":
                    try:
                        values[name] = int(env[var])
                    except ValueError:
                        raise ValueError(f"Environment variable {var}={env[var]!r} is not a valid {name}") from None
            if "master_addr" not in values and "master_addr" not in overrides and env.get("SLURM_JOB_NODELIST"):
                values["master_addr"] = first_host(env["SLURM_JOB_NODELIST"])
        values.update(overrides)
        return cls.from_dict(values)


# Fields that every rank must share, or the ranks would silently train different things (``agree=True`` above).
MUST_AGREE = tuple(f.name for f in fields(Settings) if f.metadata["agree"])


def _choices(f) -> tuple | None:
    """A field's choices: a tuple, or read now from a table (a loader, comm or parallel mode registered since)."""
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _help(f) -> str:
    """A field's help text, read now where it comes from a table."""
    return f.metadata["help"]() if callable(f.metadata["help"]) else f.metadata["help"]


def _mistyped(f, value) -> str | None:
    """The sentence for a value not of its field's type (numbers numbers, booleans True or False, names and paths
    text), or None."""
    kind = _kind(f)
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{f.name}={value!r}: must be a number"
    if kind is int and isinstance(value, float) and not value.is_integer():
        return f"{f.name}={value!r}: must be a whole number"
    if kind is bool and not isinstance(value, bool):
        return f"{f.name}={value!r}: must be True or False"
    if kind is str and not isinstance(value, str):
        return f"{f.name}={value!r}: must be text (a name, or a path in quotes)"
    return None


def field_type(name: str) -> type:
    """The type setting ``name`` takes (its flag's): int for ``epochs`` although its default is None (the recipe's)."""
    return _kind(next(f for f in fields(Settings) if f.name == name))


def _kind(f) -> type:
    """The type a field's values take (its flag's): ``type=`` where the default is None, else the default's."""
    return f.metadata.get("type", type(f.default))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field (``--batch-size``), typed and documented from the dataclass, under its
    section's heading in ``--help``."""
    groups = {name: parser.add_argument_group(f"{name} settings") for name in SECTIONS}
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        kind, group = _kind(f), groups[f.metadata["section"]]
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{_help(f)} (default: {f.default})")
        else:
            default = "" if f.default is None else f" (default: {f.default!r})"
            group.add_argument(flag, type=kind, default=None, choices=_choices(f),
                                help=f"{_help(f)}{default}")


def from_args(args: argparse.Namespace, environ=None) -> Settings:
    """Settings from parsed arguments: defaults, then torchrun's environment, then explicit flags."""
    given = {f.name: getattr(args, f.name) for f in fields(Settings)
             if getattr(args, f.name, None) is not None}
    return Settings.from_env(environ, **given)


def describe_batch(settings: Settings) -> str:
    """The effective global batch and lr, which users should always see."""
    lr = (f"{settings.lr} x {settings.global_batch_size}/{settings.lr_reference_batch} = {settings.effective_lr:.4g}"
          if settings.scale_lr else f"{settings.effective_lr:.4g} (not scaled)")
    accumulated = f" x {settings.accumulate} accumulated steps" if settings.accumulate > 1 else ""
    return (f"global batch {settings.global_batch_size} = {settings.batch_size} per rank x "
            f"{settings.world_size} rank(s){accumulated}; lr {lr};\n  {settings.epochs} epoch(s), "
            f"{settings.warmup_epochs:g} of warm-up; model {settings.arch}")
