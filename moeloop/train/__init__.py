"""moeloop.train"""
