"""moeloop.checkpoint"""
