"""moeloop.algo"""
