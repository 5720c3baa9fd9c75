"""One attention call, declared once: its features (features), the validated Request built from them (request),
packed documents' ids (segments), and the block sizes tune found for calls like it (tune_cache).
"""
