"""Speed options, each plugged into the core's tables: faster loaders (memory, libjpeg-turbo workers, DALI, nvJPEG)
into ``loaders.LOADERS``, how the gradients travel (half precision, PowerSGD, local SGD) into
``communication.COMMS``, sharding past DDP (ZeRO-1, FSDP) into ``parallel.MODES``, and the observers of what they
do (the gradients' timer, the feed check, the GPU monitor, the profiler, memory per rank) into the loop's
(``observers.register``). None is needed to understand a DDP run.

Importing this package registers them all (ddp_utils's ``__init__`` does, so every way into the kit sees the same
tables). The order matters only where an observer declares its place relative to another's.
"""
from . import gpu_monitor, feed, profile, sharding   # noqa: F401 - each registers on import
from . import comm, localsgd                         # noqa: F401 - localsgd's observer runs inside comm's
from . import memdata, dali, nvjpeg, regionjpeg      # noqa: F401 - regionjpeg: ImageNet's workers path
