"""Hardware truth: model architectures, GPU specs, KV capacity and profiled step time."""
