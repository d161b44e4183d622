"""The device-info ConfigMap sink, written like the Ascend Device Plugin writes it."""
