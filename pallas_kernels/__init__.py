"""Pallas attention kernels (flash attention: portable and Mosaic GPU; ragged paged
attention), each with a pure-jnp reference beside it."""
