"""The only part of ampdoctor that runs inside training and imports torch.

hooks (registration + handles), stats (tensor -> numbers, no I/O), session (the Doctor that attach() returns).
Nothing is imported here, so that the trace writer can use the stats layout without a circular import.
"""
