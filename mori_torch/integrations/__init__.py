"""Integrations of mori_torch with serving frameworks. Each submodule imports
its framework; importing this package imports none."""
