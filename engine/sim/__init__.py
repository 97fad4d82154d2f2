"""The simulator: the real scheduler and block manager on a virtual clock."""
