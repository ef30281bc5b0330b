// Harness build of DeepInfer's deepinfer._C for a machine without CUDA: takes the place of
// csrc/graph_timer/graph_timer_cuda.cpp. An event is a slot holding the host steady-clock time of its last record();
// a captured graph has no event-record nodes. Written for deepinfer-gateway's tests.
#include "graph_timer/graph_timer.hpp"

#include <chrono>
#include <functional>
#include <mutex>
#include <unordered_map>

namespace deepinfer::graph_timer {

namespace {

struct HostClock {
    std::mutex mutex;
    std::unordered_map<int64_t, double> recorded_ms;
    int64_t next_id = 1;
};

HostClock &host_clock() {
    static HostClock clock;
    return clock;
}

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

EventHandle::EventHandle() {
    auto &clock = host_clock();
    std::lock_guard<std::mutex> lock(clock.mutex);
    raw_event_ = clock.next_id++;
    clock.recorded_ms[raw_event_] = 0.0;
}

EventHandle::EventHandle(int64_t raw_event) : raw_event_(raw_event) {}

void EventHandle::record(int64_t, bool) const {
    auto &clock = host_clock();
    std::lock_guard<std::mutex> lock(clock.mutex);
    clock.recorded_ms[raw_event_] = now_ms();
}

void EventHandle::synchronize() const {}

bool EventHandle::query() const { return true; }

float EventHandle::elapsed_time(const EventHandle &end_event) const {
    auto &clock = host_clock();
    std::lock_guard<std::mutex> lock(clock.mutex);
    return static_cast<float>(clock.recorded_ms[end_event.raw_event_] - clock.recorded_ms[raw_event_]);
}

bool EventHandle::operator==(const EventHandle &other) const { return raw_event_ == other.raw_event_; }

std::size_t EventHandle::hash() const { return std::hash<int64_t>{}(raw_event_); }

EventRecordNodeHandle::EventRecordNodeHandle(int64_t raw_node, int64_t raw_graph_exec)
    : raw_node_(raw_node), raw_graph_exec_(raw_graph_exec) {}

EventHandle EventRecordNodeHandle::get_event() const { return EventHandle(raw_node_); }

void EventRecordNodeHandle::set_event(const EventHandle &event) { raw_node_ = event.raw_event_; }

GraphHandle::GraphHandle(py::object graph) : graph_(std::move(graph)) {}

std::vector<EventRecordNodeHandle> GraphHandle::get_event_record_nodes() const { return {}; }

bool GraphHandle::operator==(const GraphHandle &other) const { return graph_.is(other.graph_); }

std::size_t GraphHandle::hash() const { return std::hash<void *>{}(graph_.ptr()); }

}  // namespace deepinfer::graph_timer
