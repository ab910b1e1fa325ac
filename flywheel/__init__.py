"""flywheel: train coding agents with reinforcement learning, in simulation and from real use."""
