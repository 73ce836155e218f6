from django.urls import path
from refunds import views

urlpatterns = [
    path("refunds", views.request_refund),
    path("refunds/crash-after-submit", views.request_refund_then_crash),
]
