"""moeloop.rollout"""
