"""moeloop.sync"""
