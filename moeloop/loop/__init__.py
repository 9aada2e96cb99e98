"""moeloop.loop"""
