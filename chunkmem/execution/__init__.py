"""Execution: the parameter-op hook that drives a training step (``runtime``), the executor that carries
out what the device residency decides (``executor``), where the step is (``iteration``), the
end-of-backward agreement, the non-model memory profile, and gathering full values (``gather``)."""
