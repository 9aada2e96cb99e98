"""moeloop.model"""
