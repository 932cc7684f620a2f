"""Mesh, logical-axis rules, ZeRO presets and compiled-step inspection."""
