"""The device side: the ModelRunner, the jit step and sampling, shardings, checkpoint loading."""
