"""cedar.frontend"""
