"""cedar.agents"""
