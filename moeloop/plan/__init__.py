"""moeloop.plan"""
