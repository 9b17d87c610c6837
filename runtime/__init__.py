"""dejavu.runtime"""
