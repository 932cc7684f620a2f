"""What touches the device: the model runner's jitted step, the paged KV cache, and the
sampler with its penalty tables."""
