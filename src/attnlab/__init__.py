"""attnlab"""
