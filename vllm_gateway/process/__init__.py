"""The gateway as OS processes: the serve daemon, the supervisor of N processes, sd_notify,
reload, siblings.
"""
