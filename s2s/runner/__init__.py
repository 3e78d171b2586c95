"""One round on the device: the forward, sampling, CUDA graphs of all three kinds, and host-device transfers."""
