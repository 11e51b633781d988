"""What students hand in: a results table and labelled figures, made from finished run folders.

    python -m ddp_utils report runs/demo/<stamp>-ddp2 runs/demo/<stamp>-single
    python -m ddp_utils compare runs/lab4/*       # single vs DataParallel vs DDP, averaged over seeds

``report`` writes into a new folder ``reports/<YYYYmmdd-HHMMSS>/`` (or the ``--out`` folder)::

    results.md       the table (time, throughput, accuracy, speed-up, scaling efficiency); one
                     sentence per run saying what bound it (data loading, compute, communication
                     or idle time, GPU use); runs that differ only in their seed averaged (mean
                     +- std); single vs DataParallel vs DDP when the runs span several modes; the
                     learning rate and global batch of each run; the hardware; the commands
    curves.png       loss, Acc@1 and the learning rate against images seen, train (solid) and val
                     (dashed), one colour per run (per seed group: the mean, min-max shaded); the
                     lr is the third panel of this picture, not a file of its own
    time.png         where each epoch's training time went, per rank: data wait, compute,
                     communication waited for, idle (stacked bars, in % of the train time)
    throughput.png   global images/s per run, and the speed-up next to the ideal linear one

``--out DIR`` must be a new or an empty folder: a report never replaces a file. The kit's own
example pictures in ``images/`` are replaced only with ``--kit-images``; ``--out images/`` is refused.

The package, lower modules first: ``runs`` (reading run folders, seed groups), ``tables``,
``bounds`` (what the train time went to, what bound a run), ``figures`` (matplotlib lays them
out: constrained layout, wrapped titles, legends below the axes) and ``write`` (the folder and
results.md).

From a notebook: ``print(results_table(dirs))``, ``print(compare_table(dirs))``,
``plot_curves(dirs)``, ``plot_time_breakdown(dirs)``, ``plot_throughput(dirs)``,
``bottleneck_sentence(load_run(d))``, ``group_runs([load_run(d) for d in dirs])``.

How the numbers are defined:

- *train time* is the time of the training loops only (no validation, no checkpoints), as
  ``fit`` records it in ``results.json``; *speed-up* = baseline train time per epoch / this
  run's train time per epoch. Per epoch, so that a resumed run (whose results time only the
  epochs after the resume) still compares fairly. The baseline is the first 1-rank run unless
  you choose one.
- *scaling efficiency* = speed-up / (ranks / baseline ranks): 100 % means every rank added
  made training proportionally faster (the ideal, linear speed-up); the course's 2 x T4
  homework reached about 1.92x, i.e. 96 %.
- *images/s* is global (all ranks together); per rank = global / ranks.
- *images seen* after a step = step x global batch (all ranks together): runs with different
  global batches (1 rank vs 2) line up on this axis, where they would not on steps.
- *time breakdown* (per rank, summed over the epochs; ``fit`` records them): *data wait*,
  waiting for the next batch; *compute*, the step (forward, backward, optimizer), including
  the gradient all-reduce that overlapped the backward pass; *communication*, the all-reduce
  time the step still waited for after the backward pass; *idle*, the rest of the epoch (log
  points waiting for the other ranks, logging). The four add up to the train time.
  ``comm_total_s`` is all the time an all-reduce was in flight, hidden or not. Runs from
  older kits recorded only data wait and compute (communication inside compute).
- *what bound a run*: the largest of data wait, communication and idle time when it is at
  least 20 % of the train time, else the run is compute-bound.
- *seed groups*: runs whose settings.json are equal except for the seed and where or how the
  run was launched (``GROUP_IGNORED``). Their table gives mean +- sample standard deviation
  (n - 1); in the pictures and that table the speed-up is measured against the mean train
  time per epoch of the baseline's group.
- *parallel mode*: results.json's ``parallel`` (none, dp, ddp); older runs: ddp with more
  than one rank, else none. The compare table's *GPUs*: results.json's ``job_gpus``, all ranks
  together (two ranks sharing one GPU, a rehearsal on gloo, count it once).
- *per GPU* (DataParallel runs): results.json's ``gpu_util_per_device`` (mean training
  utilisation, %), ``gpu_mem_peak_mb_per_device`` (NVML's peak, the whole GPU) and
  ``torch_mem_peak_mb_per_device`` (PyTorch's own peak), index i for cuda:i, beside the averaged
  ``gpu_util`` and the fullest GPU's ``gpu_mem_peak_mb``; results.md's "What bound each run"
  line shows them.

Every figure names the hardware and data that made it (``hardware_caption``): a speed-up means
nothing without the machine it was measured on.
"""
from __future__ import annotations

from .runs import (MODE_NAMES, group_runs, hardware_caption, load_run, parallel_mode,
                   run_from_results)
from .tables import (Row, baseline_index, compare_table, format_duration, lr_notes, mean_std,
                     results_table, scaling_rows, seed_table)
from .bounds import TIME_PARTS, bottleneck_sentence, time_breakdown, time_shares
from .figures import (epoch_curves, figure_text, image_curves, lr_curve, plot_curves, plot_throughput,
                      plot_time_breakdown)
from .write import (KIT_IMAGES, REPORT_FILES, REPORTS_DIR, new_report_dir, report_dir,
                    report_markdown, train_command, write_report)

__all__ = ["MODE_NAMES", "group_runs", "hardware_caption", "load_run", "parallel_mode", "run_from_results", "Row",
           "baseline_index", "compare_table", "format_duration", "lr_notes", "mean_std", "results_table",
           "scaling_rows", "seed_table", "TIME_PARTS", "bottleneck_sentence", "time_breakdown", "time_shares",
           "epoch_curves", "figure_text", "image_curves", "lr_curve", "plot_curves", "plot_throughput",
           "plot_time_breakdown", "KIT_IMAGES", "REPORT_FILES", "REPORTS_DIR", "new_report_dir", "report_dir",
           "report_markdown", "train_command", "write_report"]
