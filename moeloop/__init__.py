"""moeloop: RL post-training and SFT for Mixture-of-Experts LLMs on PyTorch-native distributed primitives."""
__version__ = "0.1.0"
