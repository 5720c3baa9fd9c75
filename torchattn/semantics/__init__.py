"""What attention means, shared by every backend, the kernels and the oracle: which keys a query sees (masks),
the dropout keep-mask hash (dropout), the shape roles of the call's tensors (roles), and dtype rules (types).
"""
