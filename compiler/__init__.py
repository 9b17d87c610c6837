"""dejavu.compiler"""
