// Minimal logging to stderr: "gpuqd[pid] LEVEL message". systemd's journal adds the timestamp.
// Thread-safe (one write(2) per line). Not async-signal-safe.
#pragma once

#include <cstdarg>

namespace gpuq {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Sets the program name printed in each line and the lowest level printed.
void log_init(const char* program, LogLevel min_level);
// Changes the lowest level printed (gpuqd's config reload), from any thread.
void set_log_level(LogLevel min_level);
void log_message(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace gpuq

#define GPUQ_LOG_DEBUG(...) ::gpuq::log_message(::gpuq::LogLevel::kDebug, __VA_ARGS__)
#define GPUQ_LOG_INFO(...) ::gpuq::log_message(::gpuq::LogLevel::kInfo, __VA_ARGS__)
#define GPUQ_LOG_WARN(...) ::gpuq::log_message(::gpuq::LogLevel::kWarn, __VA_ARGS__)
#define GPUQ_LOG_ERROR(...) ::gpuq::log_message(::gpuq::LogLevel::kError, __VA_ARGS__)
