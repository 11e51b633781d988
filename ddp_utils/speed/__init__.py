"""Speed options: faster loaders (memory, libjpeg-turbo workers, DALI), compressed gradients, the
communication timer, the link probe and GPU monitoring. None is needed to understand a DDP run.
"""
