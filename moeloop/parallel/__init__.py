"""moeloop.parallel: the parallel layout (`Layout`, its divisibility rules) and, in submodules, how it is applied."""
from moeloop.parallel.layout import BatchInfo, Layout

__all__ = ["BatchInfo", "Layout"]
