// llmc/outlier_detector.h: flags a training loss or gradient norm that is far from its recent history, so
// the trainer can skip an update on a loss spike (flags -sl, -sg). The z-score of a new value is taken
// against the previous OUTLIER_DETECTOR_WINDOW values, before the new one joins them.
// A plain struct without pointers: the trainer copies it into checkpoints as bytes.
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <math.h>
#include <string.h>

#define OUTLIER_DETECTOR_WINDOW 128

typedef struct {
    double window[OUTLIER_DETECTOR_WINDOW];
    int count;  // values seen so far, up to the window size
    int index;  // where the next value goes (the oldest value once the window is full)
} OutlierDetector;

static inline void init_detector(OutlierDetector* d) {
    memset(d, 0, sizeof(*d));
}

// Returns (new_value - mean) / std over the window (population std), NaN while the window is not yet
// full. The mean and variance are recomputed from the window on every call rather than kept as running
// sums, whose rounding would drift over a long run. A constant window has std 0: z is then 0 for the same
// value and +-infinity for any other, which is what a skip threshold should see. A non-finite value gets
// NaN and stays out of the window: one NaN loss would otherwise blind the detector for a whole window.
static inline double update_detector(OutlierDetector* d, double new_value) {
    if (!isfinite(new_value)) return NAN;
    double z = NAN;
    if (d->count == OUTLIER_DETECTOR_WINDOW) {
        double sum = 0.0;
        for (int i = 0; i < OUTLIER_DETECTOR_WINDOW; i++) sum += d->window[i];
        double mean = sum / OUTLIER_DETECTOR_WINDOW;
        double squares = 0.0;
        for (int i = 0; i < OUTLIER_DETECTOR_WINDOW; i++) squares += (d->window[i] - mean) * (d->window[i] - mean);
        double std = sqrt(squares / OUTLIER_DETECTOR_WINDOW);
        double deviation = new_value - mean;
        if (std > 0.0) {
            z = deviation / std;
        } else {
            z = deviation == 0.0 ? 0.0 : copysign(INFINITY, deviation);
        }
    } else {
        d->count++;
    }
    d->window[d->index] = new_value;
    d->index = (d->index + 1) % OUTLIER_DETECTOR_WINDOW;
    return z;
}
