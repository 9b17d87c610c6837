"""dejavu.compiler.passes"""
