"""Pallas attention kernels with pure-jnp references (not built yet)."""
