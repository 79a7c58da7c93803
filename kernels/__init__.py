"""cedar.kernels"""
