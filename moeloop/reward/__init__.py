"""moeloop.reward"""
