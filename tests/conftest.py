import os

# 8 CPU devices for the jax backend; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# CI runs the same examples every time (a fresh machine must not draw a new failure);
# HYPOTHESIS_PROFILE=explore draws new ones, as the slow suites are meant to.
from hypothesis import settings  # noqa: E402

settings.register_profile("default", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
