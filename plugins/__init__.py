"""dejavu.plugins"""
