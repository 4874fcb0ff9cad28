// gpuqctl's commands, one source file each (cmd_<name>.cpp). Each one parses the arguments after
// its name from `cursor` (--runtime-dir among them, into `runtime_dir`), runs, and returns the
// exit status.
#pragma once

#include <string>

#include "cli.hpp"

namespace gpuq::ctl {

int cmd_status(ArgCursor& cursor, std::string& runtime_dir);
int cmd_ready(ArgCursor& cursor, std::string& runtime_dir);
int cmd_metrics(ArgCursor& cursor, std::string& runtime_dir);
int cmd_top(ArgCursor& cursor, std::string& runtime_dir);
int cmd_stop(ArgCursor& cursor, std::string& runtime_dir);
int cmd_restart(ArgCursor& cursor, std::string& runtime_dir);
int cmd_reload(ArgCursor& cursor, std::string& runtime_dir);
int cmd_submit(ArgCursor& cursor, std::string& runtime_dir);

}  // namespace gpuq::ctl
