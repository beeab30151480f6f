"""nanocore-looped-bfs: the breadth-first looped pipeline schedule, as a separately installed plugin."""

from nanocore_looped_bfs.schedule import LoopedBFSSchedule, looped_bfs_bubble

__all__ = ["LoopedBFSSchedule", "looped_bfs_bubble"]
__version__ = "0.1.0"
