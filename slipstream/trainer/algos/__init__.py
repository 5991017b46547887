"""RL algorithms as pure tensor functions behind registries: advantages and policy losses."""
