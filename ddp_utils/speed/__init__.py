"""Speed options: faster loaders (memory, libjpeg-turbo workers, DALI), compressed gradients, the
communication timer, the link probe and GPU monitoring; and sharding past DDP (ZeRO-1, FSDP), for models
larger than one GPU holds. None is needed to understand a DDP run.
"""
