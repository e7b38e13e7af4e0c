"""The Lightning layer: `GRPOModule`, the data modules and the callbacks, on top of the core."""
