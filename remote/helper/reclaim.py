# Reclaim: list and remove cache entries, every name checked again here.


class Reclaim(object):
    """reclaim: a part of Node (below); environments and images are judged by their parts."""

    def __init__(self, root_dir, fetch, venvs, containers):
        self.root_dir = root_dir
        self.fetch = fetch
        self.venvs = venvs
        self.containers = containers

    def op_reclaim(self, args, ctx):
        env_names = _arg(args, "envs", (list,), None)
        if env_names is not None and not all(isinstance(name, str) for name in env_names):
            raise bad_args("envs must be a list of environment names")
        image_names = _arg(args, "images", (list,), None)
        if image_names is not None and not all(isinstance(name, str) for name in image_names):
            raise bad_args("images must be a list of image record names")
        # With envs or images, the cache directory is optional: a reclaim of engines only.
        engines_only = env_names is not None or image_names is not None
        cache_dir = _arg_path(args, "cache_dir", None if engines_only else _REQUIRED)
        names = _arg(args, "names", (list,), None)
        collect = _arg(args, "collect", (bool,), False)
        if collect and names is None and cache_dir is not None:
            raise bad_args("collect needs the exact list of names to remove")
        if collect and self.root_dir.sha256 is None:
            raise bad_args("reclaim with collect is only available through serve --expect-sha256")
        if names is not None and not all(isinstance(name, str) for name in names):
            raise bad_args("names must be a list of strings")
        until_free = _arg(args, "until_free", (int,), None)
        if until_free is not None and (not collect or until_free < 0 or cache_dir is None):
            raise bad_args("until_free needs collect and a cache_dir, and is a number of bytes (0 or more)")
        result = {}
        if cache_dir is not None:
            result["entries"] = reclaim_entries(cache_dir, names, collect, busy=self.fetch.busy_cache_names(cache_dir),
                                                secret=self.root_dir.secret, until_free=until_free)
            if until_free is not None:
                result["free_bytes"] = cache_free_bytes(cache_dir)
        if env_names is not None:
            result["envs"] = self.venvs.envs_reclaim(env_names, collect)
        if image_names is not None:
            result["images"] = self.containers.images_reclaim(image_names, collect)
        return result
