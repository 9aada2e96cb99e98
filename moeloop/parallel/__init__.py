"""moeloop.parallel"""
